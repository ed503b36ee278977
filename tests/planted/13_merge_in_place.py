"""merge_partials that saves an allocation by writing the merged output into o1 (and lse
into lse1): the caller's arrays change under it."""
import numpy as np

EXPECT = {"13.1": "changed its input o1"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    lse = np.logaddexp(lse1, lse2)
    ref = np.where(np.isfinite(lse), lse, 0)
    w1 = np.where(np.isfinite(lse), np.exp(lse1 - ref), 0)
    w2 = np.where(np.isfinite(lse), np.exp(lse2 - ref), 0)
    o1 *= w1[..., None]
    o1 += w2[..., None] * o2
    return o1, lse
