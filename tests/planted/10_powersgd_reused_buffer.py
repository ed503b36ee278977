"""powersgd_step that keeps one output buffer per shape between calls (to save
allocations) and returns it: the next call of that shape overwrites the last result."""
import numpy as np
from minidist.comm import ring_all_reduce  # noqa: F401
from minidist.parallel.compression import orthogonalize  # noqa: F401

EXPECT = {'10.5': 'changed when it was called again'}
RANKS = 3


_BUF = {}


def powersgd_step(comm, M, Q):
    n = comm.Get_size()
    P = orthogonalize(ring_all_reduce(comm, M @ Q))
    Q_new = ring_all_reduce(comm, M.T @ P)
    out = _BUF.setdefault((M.shape, M.dtype.str), np.empty(M.shape, M.dtype))
    np.matmul(P, Q_new.T, out=out)
    out /= n
    return out, Q_new
