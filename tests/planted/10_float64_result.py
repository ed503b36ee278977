"""onebit_compress that computes in float64: float32 gradients come back float64."""
import numpy as np

EXPECT = {'10.3': "keep x's dtype"}
RANKS = 1


def onebit_compress(x, residual):
    v = x.astype(np.float64) + residual
    packed = np.packbits(v >= 0)
    scale = np.abs(v).mean()
    return packed, scale, v - np.where(v >= 0, scale, -scale)
