"""onebit_compress without error feedback: the residual is not added to x."""
import numpy as np

EXPECT = {'10.3': 'the residual is added first'}
RANKS = 1


def onebit_compress(x, residual):
    v = x.copy()
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.abs(v).mean())
    return packed, scale, v - np.where(v >= 0, scale, -scale)
