"""choose that takes the fastest layout whatever its memory."""

EXPECT = {"12.4": "it does not fit"}
RANKS = 1


def choose(estimates, cap_bytes):
    return min(estimates, key=lambda e: e.step_time_s) if estimates else None
