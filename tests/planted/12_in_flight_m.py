"""in_flight as m: every micro-batch held, as GPipe would, not 1F1B's min(p, m)."""
from fractions import Fraction

EXPECT = {"12.3": "at most p = "}
RANKS = 1


def in_flight(p, m, v=1):
    if v == 1:
        return Fraction(m)
    return min(Fraction(m), p + Fraction(p - 1, v))
