"""grid_coords with / and floor: the right numbers, as floats (2.0 is no rank)."""
import numpy as np


def grid_coords(rank, tp, pp, dp):
    return np.floor(rank / (pp * tp)), np.floor(rank / tp) % pp, rank % tp
