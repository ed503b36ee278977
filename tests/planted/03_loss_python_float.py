"""A correct vocab-parallel loss that returns the loss as a Python float, float(np.mean(...)),
as the docstring allows: it must PASS, in float32 runs too."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": None}
RANKS = 3


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    z = np.where(lo + np.arange(v) < vocab_size, logits, -np.inf)
    m = all_reduce(comm, z.max(axis=1), op="max")
    z = z - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked, op="sum")
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1), op="sum")
    return float(np.mean(np.log(s) - target)), e / s[:, None]
