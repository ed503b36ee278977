"""Planted bug: the target's logits are picked into np.zeros(n), a float64 buffer. In
float64 nothing shows; in a float32 run that all-reduce carries float64 numbers (twice the
bytes) and the loss comes out float64, and lesson 03 at --dtype float32 sends more bytes
than its formula (the project's own good student had this bug)."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": "1 of them sends in float64: the inputs are float32"}
RANKS = 3


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    z = np.where(lo + np.arange(v) < vocab_size, logits, -np.inf)
    m = all_reduce(comm, z.max(axis=1), op="max")
    z = z - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n)                                   # float64, whatever the logits are
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked, op="sum")
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1), op="sum")
    return np.mean(np.log(s) - target), e / s[:, None]
