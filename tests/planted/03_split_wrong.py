"""Planted bugs: the split always along axis 0 (rows, where a column-parallel weight is cut
by columns); the vocabulary range off by one (a target at a range's last id is missed)."""
import numpy as np


def split_for_rank(a, axis, rank, t):
    return np.array_split(a, t, axis=0)[rank]


def vocab_parallel_cross_entropy_backward(probs, targets, lo, grad):
    n, v = probs.shape
    d = probs.copy()
    mine = (targets >= lo) & (targets < lo + v - 1)
    d[mine, targets[mine] - lo] -= 1.0
    return d * grad / n
