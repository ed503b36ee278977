"""onebit_compress that adds x into the residual it was given (residual += x)."""
import numpy as np

EXPECT = {'10.3': 'changed the residual'}
RANKS = 1


def onebit_compress(x, residual):
    residual += x
    v = residual
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.abs(v).mean())
    return packed, scale, v - np.where(v >= 0, scale, -scale)
