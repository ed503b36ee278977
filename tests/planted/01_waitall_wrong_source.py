"""Planted bug: Irecv from the wrong rank, then MPI.Request.Waitall: blocked inside MPI itself,
where only cancelling the receive frees it."""
import numpy as np
from mpi4py import MPI

from minidist.comm.collectives import ring_all_reduce  # noqa: F401  (must PASS after the deadlock)


def ring_all_gather(comm, x, axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    got = np.empty(1, np.int64)
    reqs = [comm.Irecv(got, (r + 1) % n, 5), comm.Isend(np.array([len(x)], np.int64), (r + 1) % n, 5)]
    MPI.Request.Waitall(reqs)
    return x
