"""merge_partials with the log-sum-exp in base 10 (log10 of 10**lse1 + 10**lse2, shifted
by the larger): the lse the engine gives is a natural logarithm."""
import numpy as np

EXPECT = {"13.1": "the log-sum-exp in base 10"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    m = np.maximum(lse1, lse2)
    seen = np.isfinite(m)
    ref = np.where(seen, m, 0)
    w1, w2 = 10.0 ** (lse1 - ref), 10.0 ** (lse2 - ref)
    total = np.where(seen, w1 + w2, 1)
    lse = np.where(seen, ref + np.log10(total), -np.inf)
    s1, s2 = np.where(seen, w1 / total, 0), np.where(seen, w2 / total, 0)
    return s1[..., None] * o1 + s2[..., None] * o2, lse
