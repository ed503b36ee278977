"""unscale_grads that divides in place: the caller's gradients change under its feet."""
import numpy as np

EXPECT = {'10.1': 'changed gradient'}
RANKS = 1


def unscale_grads(grads, scale):
    out, found = [], False
    for g in grads:
        if g is None:
            out.append(None)
            continue
        g /= scale
        found = found or not np.isfinite(g).all()
        out.append(g.astype(np.float32, copy=False))
    return out, bool(found)
