"""partition with numpy's ceil and floor: the right bounds, as numpy floats, which are no index."""
import numpy as np

EXPECT = {"5.1": "bounds are Python ints, not numpy.float64"}
RANKS = 3


def partition(n, size, rank):
    big, small = np.ceil(n / size), np.floor(n / size)     # the first n % size ranks get big
    extra = n % size
    lo = rank * small + min(rank, extra)
    return lo, lo + (big if rank < extra else small)
