"""onebit_compress with scale = max |v| instead of the mean."""
import numpy as np

EXPECT = {'10.3': 'not its max'}
RANKS = 1


def onebit_compress(x, residual):
    v = x + residual
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.abs(v).max())
    return packed, scale, v - np.where(v >= 0, scale, -scale)

