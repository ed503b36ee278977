"""Planted bug: f's backward writes the sum into one output buffer per shape (and dtype),
allocated once: the gradient it returned before is overwritten by the next call of that
shape (a pipeline's second micro-batch, the next layer)."""
import numpy as np

from minidist.comm import all_reduce

EXPECT = {"3.2": "changed when f's backward was called again with other inputs of the same shape"}
RANKS = 3

_out = {}


def f_backward(comm, grad):
    key = (grad.shape, grad.dtype)
    if key not in _out:
        _out[key] = np.empty_like(grad)            # allocated once per shape: no allocation per step
    out = _out[key]
    out[...] = all_reduce(comm, grad, op="sum")
    return out
