"""Planted bug: the reduce-scatter's sum, never divided by N."""
from minidist.comm import ring_reduce_scatter


def reduce_scatter_grad(comm, flat):
    return ring_reduce_scatter(comm, flat, op="sum")
