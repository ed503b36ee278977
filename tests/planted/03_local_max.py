"""Planted bug: each rank shifts by its own (local) max and all-reduces the sums of
exponentials as they are: the ranks' terms carry different shifts, so the sum is wrong."""
import numpy as np

from minidist.comm import all_reduce


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    z = np.where(lo + np.arange(v) < vocab_size, logits, -np.inf)
    m = z.max(axis=1)                                  # local: all_reduce(op="max") forgotten
    all_reduce(comm, m, op="max")                      # (the bytes are right: the max is ignored)
    z = z - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1))
    return np.mean(np.log(s) - target), e / s[:, None]
