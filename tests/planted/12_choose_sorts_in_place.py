"""choose that sorts the caller's list in place."""

EXPECT = {"12.4": "the list changed"}
RANKS = 1


def choose(estimates, cap_bytes):
    estimates.sort(key=lambda e: e.step_time_s)
    return next((e for e in estimates if e.memory_bytes_per_gpu <= cap_bytes), None)
