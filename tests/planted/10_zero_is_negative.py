"""onebit_compress that sends a zero as - (v > 0)."""
import numpy as np

EXPECT = {'10.3': 'a zero counts as +'}
RANKS = 1


def onebit_compress(x, residual):
    v = x + residual
    packed = np.packbits(v > 0)
    scale = x.dtype.type(np.abs(v).mean())
    return packed, scale, v - np.where(v >= 0, scale, -scale)

