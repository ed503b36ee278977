"""Planted bug: g's backward all-reduces too (dY is already whole: every gradient becomes t dY);
f's backward forgets to reduce (each rank keeps its own part of dX)."""
from minidist.comm import all_reduce


def g_backward(comm, grad):
    return all_reduce(comm, grad, op="sum")


def f_backward(comm, grad):
    return grad
