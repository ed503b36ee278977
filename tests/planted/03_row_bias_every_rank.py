"""Planted bug: the row-parallel bias added on every rank before the sum (counted t times);
the column-parallel backward all-reduces the weight's gradient instead of the input's."""
import numpy as np

from minidist.comm import all_reduce


def row_parallel_forward(comm, x, weight, bias):
    y = x @ weight
    if bias is not None:
        y = y + bias
    return all_reduce(comm, y)


def column_parallel_backward(comm, x, weight, grad):
    gw = all_reduce(comm, np.einsum("bsi,bso->io", x, grad))
    return grad @ weight.T, gw, grad.sum(axis=(0, 1))
