"""Planted bug: op="avg" already divides by N, and the student divides again."""
from minidist.comm import ring_reduce_scatter


def reduce_scatter_grad(comm, flat):
    return ring_reduce_scatter(comm, flat, op="avg") / comm.Get_size()
