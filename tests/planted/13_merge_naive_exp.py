"""merge_partials that exponentiates lse as it is: exp(800) is inf in float64 and exp(-800)
is 0, so large log-sum-exps give inf, -inf or nan."""
import numpy as np

EXPECT = {"13.1": "shift by max(lse1, lse2)"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    e1, e2 = np.exp(lse1), np.exp(lse2)
    total = e1 + e2
    lse = np.log(total)
    safe = np.where(total > 0, total, 1)
    return (e1 / safe)[..., None] * o1 + (e2 / safe)[..., None] * o2, lse
