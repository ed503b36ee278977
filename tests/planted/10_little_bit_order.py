"""onebit_compress and onebit_decompress with bitorder='little': they agree with each
other, not with the package's messages."""
import numpy as np

EXPECT = {'10.3': "bit order is 'big'", '10.4': "bit order is 'big'"}
RANKS = 1


def onebit_compress(x, residual):
    v = x + residual
    packed = np.packbits(v >= 0, bitorder='little')
    scale = x.dtype.type(np.abs(v).mean())
    return packed, scale, v - np.where(v >= 0, scale, -scale)


def onebit_decompress(packed, scale, n):
    bits = np.unpackbits(packed, count=n, bitorder='little').astype(bool)
    return np.where(bits, scale, -scale).astype(np.asarray(scale).dtype)
