"""Planted bug: the all-reduce works in the caller's array (x += ...) and returns it."""
import numpy as np

from minidist.comm.collectives import ring_all_gather as _gather, ring_reduce_scatter as _scatter


def ring_all_reduce(comm, x, op="sum"):
    total = _gather(comm, _scatter(comm, np.reshape(x, -1), op=op)).reshape(np.shape(x))
    x[...] = total                                                    # writes into the input
    return x
