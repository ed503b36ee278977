"""unscale_grads that keeps the gradients' dtype: float16 gradients come back float16,
not the fp32 the master weights are updated with."""
import numpy as np

EXPECT = {'10.1': 'return fp32'}
RANKS = 1


def unscale_grads(grads, scale):
    out, found = [], False
    for g in grads:
        if g is None:
            out.append(None)
            continue
        u = g / g.dtype.type(scale)
        found = found or not np.isfinite(u).all()
        out.append(u)
    return out, bool(found)
