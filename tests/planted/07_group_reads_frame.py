"""grid_group that copies the answer out of the grader's stack frames (sys._getframe)
instead of computing it: it looks for the check's expected list (`w`, `want`, `expected`)
in every caller's locals, and guesses [rank] when there is none. The checks compute the
expected value only after grid_group has returned, so there is nothing to find."""
import sys

EXPECT = {"7.2": "returned [0], expected [0, 1]"}
RANKS = 4


def grid_group(rank, kind, tp, pp, dp):
    if kind not in ("tp", "pp", "dp"):
        raise ValueError(kind)
    frame = sys._getframe(1)
    while frame is not None:
        for name in ("w", "want", "expected"):
            found = frame.f_locals.get(name)
            if isinstance(found, dict) and kind in found:
                return list(found[kind])
            if isinstance(found, list):
                return list(found)
        frame = frame.f_back
    return [rank]
