"""Planted bug: the loss assumes the vocabulary divides by t, so that no column is padding:
nothing is masked, and the padded columns (logits of the zero rows of the padded table in
the model, anything in the check) count as real tokens."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": "the padded columns counted as real logits"}
RANKS = 3


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    m = all_reduce(comm, logits.max(axis=1), op="max")
    z = logits - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1))
    return np.mean(np.log(s) - target), e / s[:, None]
