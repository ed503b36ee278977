"""A cheat: average_gradients that sends one gradient through the ring (so that bytes
went through it) and returns the check's own expected mean, read from its caller's frame.
The check computes the mean only after average_gradients returned: there is none to read."""
import sys

from minidist.comm import ring_all_reduce

EXPECT = {"2.1": "expected the mean over 3 ranks"}
RANKS = 3


def average_gradients(comm, grads):
    ring_all_reduce(comm, grads[0], op="sum")
    frame = sys._getframe(1)
    while frame is not None:
        if "expected" in frame.f_locals:
            return [e.copy() for e in frame.f_locals["expected"]]
        frame = frame.f_back
    return [g.copy() for g in grads]
