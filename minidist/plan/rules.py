"""The small rules the engine and the planner both follow, stated once, here.

    python -c "from minidist.plan.rules import *; print(chunk_bounds(10, 4), segments(5, 2))"

The planner counts what the engine does, so where a count depends on a rule (how a
message is cut into chunks, how far the vocabulary is padded, which gradients share a
bucket, how blocks are grouped into checkpoints) both must use the same one. It lives
in plan/ because plan/ imports nothing of minidist's outside itself (no MPI: `python -m
minidist.plan` is arithmetic); the engine imports each rule from here:
  chunk_bounds     minidist.comm (collectives, p2p, nonblocking) and the strategies
  padded_vocab     minidist.parallel.tensor_parallel
  assign_buckets   minidist.parallel.data_parallel (exercise 2.2's answer) and zero
  segments         minidist.recompute (every-k checkpoints)
  parameter_count  the --params flag of `python -m minidist.plan` and of minidist.memory
Pure Python and the standard library only.
"""
import argparse
import math


def chunk_bounds(n, size):
    """Offsets [b0=0, b1, ..., b_size=n] of numpy.array_split(range(n), size): chunk c is
    [b_c, b_c+1); the first n % size chunks are one longer."""
    q, r = divmod(n, size)
    return [c * q + min(c, r) for c in range(size + 1)]


def padded_vocab(vocab_size, t):
    """The vocabulary rounded up to a multiple of t, so that each of t ranks holds the same
    rows of the token table. Megatron-LM pads to a multiple of 128 t (its
    _vocab_size_with_padding, megatron/training/tokenizer/tokenizer.py: the flag
    --make-vocab-size-divisible-by, default 128, times t); this project's choice is t."""
    return -(-vocab_size // t) * t


def assign_buckets(nbytes, bucket_bytes):
    """Which parameters share a bucket: lists of parameter indices, first bucket first.

    Walk the parameters from the last to the first (backward produces the last layers'
    gradients first), adding each to the open bucket; close the bucket as soon as it
    holds at least bucket_bytes. The last bucket may be smaller. (Exercise 2.2.)
    """
    buckets, group, size = [], [], 0
    for i in reversed(range(len(nbytes))):
        group.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            buckets.append(group)
            group, size = [], 0
    if group:
        buckets.append(group)
    return buckets


def segments(n_layer, size):
    """[(lo, hi)]: the blocks of each checkpoint, size at a time (the last may be shorter)."""
    return [(lo, min(lo + size, n_layer)) for lo in range(0, n_layer, size)]


SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parameter_count(text):
    """argparse type: 7.5e9, 7500000000, 7.5B, 70b, 350M, 1.2T -> a positive float."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = SUFFIX.get(t[-1:].lower(), 1.0) if t[-1:].isalpha() else 1.0
    try:
        v = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError("expected a parameter count such as 7.5e9, 7.5B, 350M or "
                                         f"1.2T, got {text!r}")
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive parameter count, got {text!r}")
    return v
