"""bubble_fraction as (p-1)/m: the bubble beside the ideal compute time, not of the total."""
from fractions import Fraction

EXPECT = {"12.2": "(p-1)/m is the bubble beside the ideal compute time"}
RANKS = 1


def bubble_fraction(schedule, p, m, v=1, costs=(1, 2, 1)):
    if schedule == "naive":
        return Fraction(p - 1, p)
    if schedule in ("gpipe", "1f1b"):
        return Fraction(p - 1, m)
    if schedule == "interleaved":
        return Fraction(p - 1, v * m)
    if schedule == "zb-h1":
        f, b, w = map(Fraction, costs)
        idle = (p - 1) * (f + b - 2 * w)
        return idle / (m * (f + b) + idle)
    raise ValueError(schedule)
