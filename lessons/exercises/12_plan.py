"""Exercise 12: the planner's arithmetic, by hand: ZeRO's memory per device, the pipeline's
bubble and the micro-batches in flight, and choosing a layout under a memory cap.

Four functions, each mirroring the package's by name and signature:

- 12.1 `model_state_bytes` (minidist/plan/memory.py): bytes per device of weights,
  gradients and optimizer state at ZeRO stage 0-3;
- 12.2 `bubble_fraction` (minidist/plan/pipeline.py): the idle fraction of a pipeline
  schedule's total time;
- 12.3 `in_flight` (minidist/plan/pipeline.py): the micro-batches whose activations the
  first stage holds at its peak;
- 12.4 `choose` (minidist/plan/choose.py): the fastest layout that fits under a cap.

All four are plain Python in one process:

    python -m minidist.grade lessons/exercises/12_plan.py

After the unit checks, each check plugs your function into the package and runs lesson
12 with it (python -m minidist.lessons.12_plan, 7B on 16 GPUs), which holds the ZeRO memory to
the paper's published figures, the bubble and the in-flight count to a simulation of the
schedule, and the chosen layout to the rule (it fits, and nothing that fits is faster).

Exact means exact: 70e9 parameters x 16 bytes is 1.12e12, a number float32 cannot hold
to the byte; the bubble is a ratio of whole numbers, and a Fraction keeps it so.
"""
from fractions import Fraction  # noqa: F401  (you will want it: Fraction(1, 3) is exact, 1 / 3 is not)


def model_state_bytes(psi, n_d, stage, accounting="zero"):
    """{"weights": ..., "grads": ..., "optimizer": ...}: bytes per device of the model states
    of `psi` parameters trained with ZeRO stage `stage` over `n_d` data-parallel ranks
    (Rajbhandari et al. 2020, arXiv 1910.02054, section 3 and Figure 1).

    accounting: bytes per parameter of (weights, gradients, optimizer state), as a tuple,
    or one of the names:
        "zero"      (2, 2, 12)   the paper: fp16 weights and gradients; fp32 master weights,
                                 momentum and variance (16 B per parameter)
        "megatron"  (2, 4, 12)   Megatron-LM: bf16 weights, fp32 main gradients (18 B)
        "fp32"      (4, 4, 8)    plain fp32 AdamW: weights, gradients, m and v
    Stage 0 (plain data parallelism) keeps all three whole on every device; stage 1 cuts
    the optimizer state in n_d; stage 2 the gradients too; stage 3 the weights too (each
    cut piece is 1/n_d of the whole: Psi / n_d parameters' worth). With w, g, k the bytes
    per parameter: stage 1 holds (w + g) Psi + k Psi/n_d; Megatron's distributed optimizer
    is stage 1 of "megatron": 6 + 12/d bytes per parameter.

    Return Python numbers (int or float, never numpy's or float32), exact to float64's
    last digits. A stage other than 0, 1, 2, 3, or an unknown accounting name, is a
    ValueError.
    """
    raise NotImplementedError("exercise 12.1: model_state_bytes")


def bubble_fraction(schedule, p, m, v=1, costs=(1, 2, 1)):
    """The bubble: the fraction of a step's total time that a stage sits idle, for p
    stages and m micro-batches, as a fractions.Fraction (an int 0 is fine for no bubble).

    schedule:
        "naive"        one micro-batch through the whole pipeline at a time: (p-1)/p
        "gpipe", "1f1b"   (p-1)/(m+p-1) (Narayanan et al. 2021, eq. 1; 1F1B reorders the
                       work to hold fewer activations, and idles just as long)
        "interleaved"  v model chunks per stage (m a multiple of p when v > 1):
                       (p-1)/(v m + p-1); with v = 1 it is 1F1B
        "zb-h1"        zero bubble H1 (Qi et al. 2024): costs = (f, b, w) are one stage's
                       forward, whole backward and the weight-gradient part of b (B = b - w
                       computes the input gradient); each stage idles (p-1)(f + B - w) =
                       idle, and the bubble is idle / (m (f + b) + idle)
    Any other name is a ValueError. costs matter for "zb-h1" only.
    """
    raise NotImplementedError("exercise 12.2: bubble_fraction")


def in_flight(p, m, v=1):
    """Micro-batches whose activations the FIRST stage holds at its peak under 1F1B, in
    units of one micro-batch through all of that stage's layers, as a Fraction (or int).

    v = 1 (1F1B): the first stage runs its warm-up forwards, one per later stage and its
    own, before its first backward: p of them, or all m when there are fewer.
    v > 1 (interleaved, m a multiple of p): the first stage runs v p + p - 1 chunk forwards
    before its first backward (Megatron-LM's warm-up, 2(p-1) + (v-1)p, plus one), each
    chunk 1/v of its layers, never more than all v m chunks of its m micro-batches:
    p (1 + (p-1)/(p v)) when m > p (Korthikanti et al. 2022, section 4.2.3).
    """
    raise NotImplementedError("exercise 12.3: in_flight")


def choose(estimates, cap_bytes):
    """The fastest estimate that fits under `cap_bytes`, or None when none fits.

    estimates: a list of objects with `.step_time_s` (seconds per step) and
    `.memory_bytes_per_gpu` (bytes on the most loaded GPU), as minidist.plan.search
    returns them. An estimate fits when its memory is at most the cap (a layout that needs
    exactly the cap fits). Among those that fit, return the one with the smallest step
    time; between equal step times, the one earlier in the list. Return the object itself
    (not a copy, not its index), and leave the list as it was (do not sort it in place).
    """
    raise NotImplementedError("exercise 12.4: choose")
