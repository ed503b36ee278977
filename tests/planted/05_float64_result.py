"""reduce_scatter_grad dividing into a new float64 array: right in float64, but a float32
gradient comes back as float64 (twice the bytes ZeRO keeps, and lesson 05's dtype lost)."""
import numpy as np

from minidist.comm import ring_reduce_scatter

EXPECT = {"5.2": "the result is float64, the gradient is float32"}
RANKS = 3


def reduce_scatter_grad(comm, flat):
    mine = ring_reduce_scatter(comm, flat, op="sum")
    out = np.zeros(mine.shape)                  # the bug: float64 whatever the gradient's dtype
    np.divide(mine, comm.Get_size(), out=out)
    return out
