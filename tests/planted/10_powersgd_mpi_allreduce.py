"""powersgd_step that sums with MPI's own Allreduce instead of minidist's ring."""
import numpy as np
from minidist.comm import ring_all_reduce  # noqa: F401
from minidist.parallel.compression import orthogonalize  # noqa: F401

EXPECT = {'10.5': 'called comm.Allreduce: use ring_all_reduce(comm, P)'}
RANKS = 3


def powersgd_step(comm, M, Q):
    n = comm.Get_size()
    P = M @ Q
    comm.Allreduce(P.copy(), P)
    P = orthogonalize(P)
    Q_new = M.T @ P
    comm.Allreduce(Q_new.copy(), Q_new)
    return P @ Q_new.T / n, Q_new
