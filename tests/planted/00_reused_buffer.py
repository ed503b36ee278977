"""layer_norm_backward summing grad_weight and grad_bias into buffers kept per channel count
(to save allocations): every LayerNorm of the model has the same C, so the next layer's
backward overwrites the gradients the last one handed to the engine."""
import numpy as np

EXPECT = {"0.2": "changed when it was called again"}
RANKS = 1
_BUF = {}


def layer_norm_backward(xhat, rstd, weight, grad):
    C = xhat.shape[-1]
    gw, gb = _BUF.setdefault((C, grad.dtype), (np.empty(C, grad.dtype), np.empty(C, grad.dtype)))
    np.sum((grad * xhat).reshape(-1, C), axis=0, out=gw)
    np.sum(grad.reshape(-1, C), axis=0, out=gb)
    g = grad * weight
    gx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return gx, gw, gb
