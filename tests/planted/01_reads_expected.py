"""A cheat: ring_all_reduce that sends the ring's bytes (the package's ring on zeros) and
returns the check's own expected answer, read from its caller's frame. The check computes
the answer only after ring_all_reduce returned: there is none to read."""
import sys

import numpy as np

from minidist.comm import collectives

EXPECT = {"1.3": "float64, op 'sum': got [0.], expected"}
RANKS = 3


def ring_all_reduce(comm, x, op="sum"):
    out = collectives.ring_all_reduce(comm, np.zeros_like(x), op=op)
    frame = sys._getframe(1)
    while frame is not None:
        want = frame.f_locals.get("want")
        if want is not None and np.shape(want) == np.shape(x):
            return np.array(want, dtype=np.asarray(x).dtype)
        frame = frame.f_back
    return out
