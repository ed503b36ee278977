"""merge_partials with np.logaddexp and no guard for rows that saw no key on either side:
exp(-inf - (-inf)) is nan, and the nan spreads through the ring's result."""
import numpy as np

EXPECT = {"13.1": "nan where a side is -inf"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    lse = np.logaddexp(lse1, lse2)
    return np.exp(lse1 - lse)[..., None] * o1 + np.exp(lse2 - lse)[..., None] * o2, lse
