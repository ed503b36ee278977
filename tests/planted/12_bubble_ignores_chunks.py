"""bubble_fraction that forgets the interleaved schedule's v chunks."""
from fractions import Fraction

EXPECT = {"12.2": "chunks per stage: v m + p - 1 below"}
RANKS = 1


def bubble_fraction(schedule, p, m, v=1, costs=(1, 2, 1)):
    if schedule == "naive":
        return Fraction(p - 1, p)
    if schedule in ("gpipe", "1f1b", "interleaved"):
        return Fraction(p - 1, m + p - 1)
    if schedule == "zb-h1":
        f, b, w = map(Fraction, costs)
        idle = (p - 1) * (f + b - 2 * w)
        return idle / (m * (f + b) + idle)
    raise ValueError(schedule)
