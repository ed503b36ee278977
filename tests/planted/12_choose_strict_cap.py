"""choose with < where the cap allows <=: a layout needing exactly the cap is refused."""

EXPECT = {"12.4": "a layout needing exactly the cap fits"}
RANKS = 1


def choose(estimates, cap_bytes):
    fitting = [e for e in estimates if e.memory_bytes_per_gpu < cap_bytes]
    return min(fitting, key=lambda e: e.step_time_s) if fitting else None
