"""Planted bug: the one-hot of the targets is np.zeros((n, v)), float64: probs - onehot is
float64 in a float32 run, so the gradient of the logits changes dtype."""
import numpy as np

EXPECT = {"3.11": "the result is float64, probs is float32"}
RANKS = 3


def vocab_parallel_cross_entropy_backward(probs, targets, lo, grad):
    n, v = probs.shape
    onehot = np.zeros((n, v))
    mine = (targets >= lo) & (targets < lo + v)
    onehot[np.flatnonzero(mine), targets[mine] - lo] = 1.0
    return (probs - onehot) * grad / n
