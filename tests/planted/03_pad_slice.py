"""Planted bug: the real columns taken as logits[:, :vocab_size - lo], which assumes that
the padding sits at the end of the last rank's columns: on a rank that holds padding only
(a vocabulary smaller than t squared) vocab_size - lo is 0 or negative, and the slice is
empty or keeps padded columns."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": "zero-size array to reduction operation maximum"}
RANKS = 3


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    real = logits[:, :vocab_size - lo]                       # drop the padding at the end
    m = all_reduce(comm, real.max(axis=1), op="max")
    z = real - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1))
    probs = np.zeros_like(logits)
    probs[:, :real.shape[1]] = e / s[:, None]
    return np.mean(np.log(s) - target), probs
