"""unscale_grads that looks for infs with np.isinf: a nan (0 * inf, inf - inf) slips
through and the step is taken with nan gradients."""
import numpy as np

EXPECT = {'10.1': 'a nan is not an inf'}
RANKS = 1


def unscale_grads(grads, scale):
    out, found = [], False
    for g in grads:
        if g is None:
            out.append(None)
            continue
        u = np.asarray(g, dtype=np.float32) / np.float32(scale)
        found = found or bool(np.isinf(u).any())
        out.append(u)
    return out, bool(found)
