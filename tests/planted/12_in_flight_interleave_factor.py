"""in_flight with the interleaving factor misread: p (1 + (p-1)/p * v) instead of
p (1 + (p-1)/(p v))."""
from fractions import Fraction

EXPECT = {"12.3": "count chunks as 1/v of a micro-batch"}
RANKS = 1


def in_flight(p, m, v=1):
    if v == 1:
        return Fraction(min(p, m))
    return min(Fraction(v * m), p * (1 + Fraction(p - 1, p) * v))
