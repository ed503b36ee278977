"""Planted bug: the right loss from the whole logits, all-gathered: b*s*v numbers move
instead of 3 b*s."""
import numpy as np

from minidist.comm import ring_all_gather


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    whole = ring_all_gather(comm, logits, axis=1)[:, :vocab_size]
    m = whole.max(axis=1, keepdims=True)
    e = np.exp(whole - m)
    s = e.sum(axis=1, keepdims=True)
    loss = np.mean(np.log(s[:, 0]) + m[:, 0] - whole[np.arange(len(targets)), targets])
    probs = np.zeros_like(logits)
    hi = min(lo + logits.shape[1], vocab_size)
    if hi > lo:
        probs[:, :hi - lo] = (e / s)[:, lo:hi]
    return loss, probs
