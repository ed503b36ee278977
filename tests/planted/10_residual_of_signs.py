"""onebit_compress whose residual is v minus the signs (+-1), forgetting the scale."""
import numpy as np

EXPECT = {'10.3': 'not the signs'}
RANKS = 1


def onebit_compress(x, residual):
    v = x + residual
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.abs(v).mean())
    return packed, scale, v - np.where(v >= 0, 1, -1).astype(x.dtype)
