"""Planted bug: the loss shifts the caller's logits in place (logits -= m)."""
import numpy as np

from minidist.comm import all_reduce


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    logits[:, lo + np.arange(v) >= vocab_size] = -np.inf
    m = all_reduce(comm, logits.max(axis=1), op="max")
    logits -= m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n)
    picked[mine] = logits[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    np.exp(logits, out=logits)
    s = all_reduce(comm, logits.sum(axis=1))
    return np.mean(np.log(s) - target), logits / s[:, None]
