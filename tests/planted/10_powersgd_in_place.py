"""powersgd_step that divides M by N in place (M /= n) to save a copy."""
import numpy as np
from minidist.comm import ring_all_reduce  # noqa: F401
from minidist.parallel.compression import orthogonalize  # noqa: F401

EXPECT = {'10.5': 'powersgd_step changed M'}
RANKS = 3


def powersgd_step(comm, M, Q):
    n = comm.Get_size()
    M /= n
    P = orthogonalize(ring_all_reduce(comm, M @ Q))
    Q_new = ring_all_reduce(comm, M.T @ P)
    return P @ Q_new.T, Q_new * n
