"""Planted bug: the padding masked on the last rank only ("the vocabulary is padded at its
end"): right while the padding fits on the last rank, wrong when it spans several ranks
(a vocabulary smaller than t squared: on 3 ranks, 1 id padded to 3 puts padding on ranks 1
and 2; on 4 ranks, 5 ids padded to 8 on ranks 2 and 3)."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": "padding masked on the last rank only"}
RANKS = 3


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    z = logits.copy()
    if comm.Get_rank() == comm.Get_size() - 1:             # the padding is at the end of the vocabulary
        z[:, max(vocab_size - lo, 0):] = -np.inf
    m = all_reduce(comm, z.max(axis=1), op="max")
    z = z - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1))
    return np.mean(np.log(s) - target), e / s[:, None]
