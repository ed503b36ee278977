"""powersgd_step that forgets to divide by N: the sum of the approximations."""
import numpy as np
from minidist.comm import ring_all_reduce  # noqa: F401
from minidist.parallel.compression import orthogonalize  # noqa: F401

EXPECT = {'10.5': 'divide by N = comm.Get_size()'}
RANKS = 3


def powersgd_step(comm, M, Q):
    n = comm.Get_size()
    P = orthogonalize(ring_all_reduce(comm, M @ Q))
    Q_new = ring_all_reduce(comm, M.T @ P)
    return P @ Q_new.T, Q_new
