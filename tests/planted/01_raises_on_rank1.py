"""Planted bug: rank 1 raises (an index error) while the others wait for its messages."""
import numpy as np

from minidist.comm.collectives import ring_all_gather as _gather


def ring_all_gather(comm, x, axis=0):
    if comm.Get_rank() == 1:
        lengths = []
        return lengths[3]
    return _gather(comm, x, axis=axis)
