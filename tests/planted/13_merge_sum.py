"""merge_partials that adds the two partial outputs: each was normalised over its own keys,
so the sum counts the softmax mass twice."""
import numpy as np

EXPECT = {"13.1": "not a plain sum or mean"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    return o1 + o2, np.logaddexp(lse1, lse2)
