"""powersgd_step that all-reduces M itself, then does the rest locally: the right
answer, and n x m numbers sent where PowerSGD sends r(n + m)."""
import numpy as np
from minidist.comm import ring_all_reduce  # noqa: F401
from minidist.parallel.compression import orthogonalize  # noqa: F401

EXPECT = {'10.5': 'the bytes of a ring all-reduce of M itself'}
RANKS = 3


def powersgd_step(comm, M, Q):
    n = comm.Get_size()
    S = ring_all_reduce(comm, M)
    P = orthogonalize(S @ Q)
    Q_new = S.T @ P
    return P @ Q_new.T / n, Q_new
