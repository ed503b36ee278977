"""merge_partials with the log-sum-exp in base 2 (np.logaddexp2, np.exp2): the lse the
engine gives is a natural logarithm."""
import numpy as np

EXPECT = {"13.1": "the log-sum-exp in base 2"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    lse = np.logaddexp2(lse1, lse2)
    ref = np.where(np.isfinite(lse), lse, 0)
    w1 = np.where(np.isfinite(lse), np.exp2(lse1 - ref), 0)
    w2 = np.where(np.isfinite(lse), np.exp2(lse2 - ref), 0)
    return w1[..., None] * o1 + w2[..., None] * o2, lse
