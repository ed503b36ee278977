"""Planted bug: off by one rank: each rank takes its left neighbour's piece."""
import numpy as np


def split_for_rank(a, axis, rank, t):
    return np.array_split(a, t, axis=axis)[rank - 1]
