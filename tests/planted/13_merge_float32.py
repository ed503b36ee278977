"""merge_partials that computes in float32 ("fast enough") and casts back: the dtype is
right, the values are 1e-7 off, and the lesson's float64 run no longer matches to 1e-10."""
import numpy as np

EXPECT = {"13.1": "computed in float32 on the way?"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    a, b = lse1.astype(np.float32), lse2.astype(np.float32)
    lse = np.logaddexp(a, b)
    ref = np.where(np.isfinite(lse), lse, 0)
    w1 = np.where(np.isfinite(lse), np.exp(a - ref), 0)
    w2 = np.where(np.isfinite(lse), np.exp(b - ref), 0)
    o = w1[..., None] * o1.astype(np.float32) + w2[..., None] * o2.astype(np.float32)
    return o.astype(o1.dtype), lse.astype(lse1.dtype)
