"""merge_partials that averages the two partial outputs instead of weighing each by its
share of the softmax mass, exp(lse_i - lse): right only when lse1 == lse2."""
import numpy as np

EXPECT = {"13.1": "not a plain sum or mean"}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    return (o1 + o2) / 2, np.logaddexp(lse1, lse2)
