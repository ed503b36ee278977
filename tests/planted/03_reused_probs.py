"""Planted bug: the probabilities live in one buffer per shape and dtype, reused by every
call: the probs the backward of an earlier call needs are overwritten by the next forward
(lesson 07's pipeline runs several forwards before their backwards)."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.10": "changed when vocab_parallel_cross_entropy_forward was called again with other inputs of the "
                  "same shape"}
RANKS = 3

_probs = {}


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    key = (logits.shape, logits.dtype)
    if key not in _probs:
        _probs[key] = np.empty_like(logits)
    probs = _probs[key]
    pad = lo + np.arange(v) >= vocab_size
    m = all_reduce(comm, np.where(pad, -np.inf, logits).max(axis=1), op="max")
    np.subtract(logits, m[:, None], out=probs)
    probs[:, pad] = -np.inf
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = probs[mine, targets[mine] - lo]
    target = all_reduce(comm, picked)
    np.exp(probs, out=probs)
    s = all_reduce(comm, probs.sum(axis=1))
    probs /= s[:, None]
    return (np.log(s) - target).mean(), probs
