"""Planted bug: the mean divides by 4, written into the code: right at -n 4 only."""
from minidist.comm import ring_reduce_scatter


def reduce_scatter_grad(comm, flat):
    return ring_reduce_scatter(comm, flat, op="sum") / 4     # the bug: not comm.Get_size()
