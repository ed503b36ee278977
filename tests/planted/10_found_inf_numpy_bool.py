"""unscale_grads that returns found_inf as NumPy gives it, a numpy.bool_: right beside the
package's update_scale, but an update_scale that tests `found_inf is True` never backs off."""
import numpy as np

EXPECT = {"10.1": "got numpy.bool_"}
RANKS = 1


def unscale_grads(grads, scale):
    out, found = [], np.False_
    for g in grads:
        if g is None:
            out.append(None)
            continue
        u = np.asarray(g, dtype=np.float32) / np.float32(scale)
        found = found | ~np.isfinite(u).all()
        out.append(u)
    return out, found
