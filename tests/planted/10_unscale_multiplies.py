"""unscale_grads that multiplies by the scale."""
import numpy as np

EXPECT = {'10.1': 'multiplied by the scale'}
RANKS = 1


def unscale_grads(grads, scale):
    out, found = [], False
    for g in grads:
        if g is None:
            out.append(None)
            continue
        u = np.asarray(g, dtype=np.float32) * np.float32(scale)
        found = found or not np.isfinite(u).all()
        out.append(u)
    return out, bool(found)
