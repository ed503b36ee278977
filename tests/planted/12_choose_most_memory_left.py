"""choose that takes the layout leaving the most memory free."""

EXPECT = {"12.4": "the most memory left is not the goal"}
RANKS = 1


def choose(estimates, cap_bytes):
    fitting = [e for e in estimates if e.memory_bytes_per_gpu <= cap_bytes]
    return min(fitting, key=lambda e: e.memory_bytes_per_gpu) if fitting else None
