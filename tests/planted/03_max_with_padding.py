"""Planted bug: the row max is taken over all this rank's columns, padding included; the
padding is masked only afterwards, in the exponentials. The shift is harmless while the
padded logits are small, but a padded logit far above the real ones makes every real
exp(logit - max) underflow to 0: the sum is 0 and the loss infinite."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": "as -inf in the max as in the sum"}
RANKS = 3


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    m = all_reduce(comm, logits.max(axis=1), op="max")     # padding counted in the max
    z = logits - m[:, None]
    z[:, lo + np.arange(v) >= vocab_size] = -np.inf        # ... and masked after: probability 0
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.mean(np.log(s) - target), e / s[:, None]
