"""Pipeline parallelism's formulas: the bubble, the micro-batches in flight, the bytes that
cross a stage boundary.

Bubble fractions of the total time (docs/reference.md#pipeline-bubbles), p stages, m
micro-batches, forward and backward of one micro-batch on one stage taking f and b:
    naive (one micro-batch at a time)   (p-1)/p
    GPipe, 1F1B                         (p-1)/(m+p-1)
    interleaved 1F1B, v chunks          (p-1)/(v m + p-1)
(Narayanan et al. 2021 give the bubble beside the ideal compute time instead: (p-1)/m in
their eq. 1 and (1/v)(p-1)/m in section 2.2.2; t/(t + ideal) turns those into the
fractions of the total above.)
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


def live_chunks(schedule, p, m, v=1, rank=0):
    """(micro-batch, chunk) pairs whose activations rank `rank` holds at its peak, as
    parallel/schedules.py's simulator counts them (None for schedules without a closed
    form here): GPipe all m; 1F1B min(p - r, m), the warm-up's forwards plus one
    (Narayanan et al. 2021, section 2.2.1); interleaved with v chunks (m a multiple of
    p) Megatron-LM's warm-up, 2(p - r - 1) + (v - 1)p forwards, plus one, at most m v."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule == "interleaved":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    return None


def in_flight(p, m, v=1):
    """Micro-batches whose activations the first stage holds at its peak, in units of one
    micro-batch through all of that stage's layers, as a Fraction: min(p, m) under 1F1B;
    interleaved (v chunks, each 1/v of the stage's layers, m a multiple of p)
    (v p + p - 1)/v = p (1 + (p-1)/(p v)) (Korthikanti et al. 2022, section 4.2.3),
    never more than all m micro-batches."""
    return Fraction(live_chunks("1f1b" if v == 1 else "interleaved", p, m, v), v)


def p2p_bytes(b, s, h, itemsize):
    """Bytes of one activation (or its gradient) crossing one stage boundary for one
    micro-batch in one direction: the (b, s, h) residual stream."""
    return b * s * h * itemsize
