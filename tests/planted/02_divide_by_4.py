"""Planted bug: divides by 4, a number written into the code: the mean at -n 4 only.
Graded at -n 4, where the world's mean is right; the groups of 3 ranks and of 1 must FAIL it."""
from minidist.comm import ring_all_reduce


def average_gradients(comm, grads):
    return [ring_all_reduce(comm, g, op="sum") / 4 for g in grads]
