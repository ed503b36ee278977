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
        idle = idle_time("zb-h1", p, f, b - w, w)
        return idle / (m * (f + b) + idle)
    raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")


# the bubble fractions' written forms, as the lessons print them beside bubble_fraction
BUBBLE_TEXT = {"naive": "(p-1)/p", "gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
               "interleaved": "(p-1)/(v m+p-1)", "zb-h1": "(p-1)(f+B-W)/T, Qi et al."}


def bubble_text(schedule, v=1):
    """bubble_fraction's formula, written out: interleaved with one chunk is 1F1B's."""
    return BUBBLE_TEXT["1f1b" if schedule == "interleaved" and v == 1 else schedule]


def idle_time(schedule, p, f, b, w):
    """Idle time of each rank in one step, m >= p and equal stages, in the units of f, b, w:
    the forward, the input-gradient part of the backward (B) and the weight-gradient part
    (W) of one micro-batch on one stage. 1F1B, whose backward is B + W: (p-1)(f + B + W),
    the bubble's fill and drain; ZB-H1, which runs the W of the drain's micro-batches in
    the bubble: (p-1)(f + B - W) (Qi et al. 2024, arXiv 2401.10241, section 2.1)."""
    if schedule == "1f1b":
        return (p - 1) * (f + b + w)
    if schedule == "zb-h1":
        return (p - 1) * (f + b - w)
    raise ValueError(f"idle_time knows 1f1b and zb-h1, not {schedule!r}")


def warmup_forwards(p, m, v, rank, factor=2):
    """Forwards rank runs before it alternates under interleaved 1F1B (v chunks):
    factor (p-r-1) + (v-1) p, at most all m v. Megatron-LM's warm-up has factor 2
    (megatron/core/pipeline_parallel/schedules.py, get_pp_rank_microbatches, with
    microbatch_group_size_per_vp_stage at its default p); factor 1 is this project's
    variant without it, which lesson 04 simulates beside it."""
    return min(factor * (p - rank - 1) + (v - 1) * p, m * v)


def latency_fill_drain(p, v, latency):
    """What messages of `latency` add to a step whose steady state has slack enough to hide
    them: the fill and the drain each cross the p v - 1 boundaries of the virtual stages,
    2 (p v - 1) latency (p > 1: every boundary is then a message between two ranks; the
    simulator agrees for latencies up to one chunk's forward, tests/test_plan_formulas.py)."""
    return 2 * (p * v - 1) * latency


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
        return min(warmup_forwards(p, m, v, rank) + 1, m * v)
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


def step_p2p_bytes(p, v, m, b, s, h, itemsize):
    """Bytes one pipeline replica sends point-to-point in one step: each of m micro-batches
    crosses the p v - 1 boundaries of the virtual stages forward (its activation) and
    backward (that activation's gradient), 2 (p v - 1) m b s h itemsize."""
    return 2 * (p * v - 1) * m * p2p_bytes(b, s, h, itemsize)
