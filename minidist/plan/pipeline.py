"""Pipeline parallelism's formulas: the bubble, the micro-batches in flight, the bytes that
cross a stage boundary.

Bubble fractions of the total time (docs/reference.md#pipeline-bubbles), p stages, m
micro-batches, forward and backward of one micro-batch on one stage taking f and b:
    naive (one micro-batch at a time)   (p-1)/p
    GPipe, 1F1B                         (p-1)/(m+p-1)          (Narayanan et al. 2021, eq. 1)
    interleaved 1F1B, v chunks          (p-1)/(v m + p-1)      (their section 2.2.2)
    ZB-H1 (b split into B and W)        (p-1)(f+B-W) of idle time per rank (Qi et al. 2024)
parallel/schedules.py simulates the schedules themselves; tests/test_schedules.py holds
these formulas to the simulation exactly.
"""
from fractions import Fraction

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


def bubble_fraction(schedule, p, m, v=1, costs=(1, 2, 1)):
    """The bubble fraction of the total time the literature gives, as a Fraction; costs:
    (f, b, w), the forward, the backward and (zb-h1) the weight-gradient part of b."""
    f, b, w = (Fraction(c) for c in costs)
    if schedule == "naive":
        return Fraction(p - 1, p)
    if schedule in ("gpipe", "1f1b") or (schedule == "interleaved" and v == 1):
        return Fraction(p - 1, m + p - 1)
    if schedule == "interleaved":
        return Fraction(p - 1, v * m + p - 1)
    if schedule == "zb-h1":                        # idle (p-1)(f + B - W) per rank, B = b - w
        idle = (p - 1) * (f + (b - w) - w)
        return idle / (m * (f + b) + idle)
    raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")


def in_flight(p, m, v=1):
    """Micro-batches whose activations the first stage holds at its peak, in units of one
    micro-batch through all of that stage's layers, as a Fraction.

    1F1B (v = 1): min(p, m), the warm-up's forwards (Narayanan et al. 2021, section 2.2.1).
    Interleaved, v chunks (m a multiple of p): the first rank runs v p + p - 1 chunk
    forwards before its first backward (Megatron-LM's warm-up, 2(p-1) + (v-1)p, plus one),
    each 1/v of its layers: p (1 + (p-1)/(p v)) (Korthikanti et al. 2022, section 4.2.3),
    and never more than all m micro-batches."""
    if v == 1:
        return Fraction(min(p, m))
    return Fraction(min(v * m, v * p + p - 1), v)


def p2p_bytes(b, s, h, itemsize):
    """Bytes of one activation (or its gradient) crossing one stage boundary for one
    micro-batch in one direction: the (b, s, h) residual stream."""
    return b * s * h * itemsize
