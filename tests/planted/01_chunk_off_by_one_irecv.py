"""Planted bug: the all-gather receives into the wrong piece ((r - s + 1) % n instead of
(r - s - 1) % n) with Irecv and MPI.Request.Waitall: with uneven pieces MPI itself reports
"Message truncated", which the grader puts in the ring's words."""
import numpy as np
from mpi4py import MPI


def ring_all_gather(comm, x, axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    lengths = np.zeros(n, np.int64)
    lengths[r] = rows.shape[0]
    for s in range(n - 1):
        i, j = (r - s) % n, (r - s - 1) % n
        got = np.empty(1, np.int64)
        comm.Sendrecv(lengths[i:i + 1].copy(), (r + 1) % n, 3, got, (r - 1) % n, 3)
        lengths[j] = got[0]
    b = np.concatenate([[0], np.cumsum(lengths)])
    out = np.empty((int(b[-1]),) + rows.shape[1:], x.dtype)
    out[b[r]:b[r + 1]] = rows
    for s in range(n - 1):
        i, j = (r - s) % n, (r - s + 1) % n                  # should receive piece (r - s - 1) % n
        reqs = [comm.Irecv(out[b[j]:b[j + 1]], (r - 1) % n, 4), comm.Isend(out[b[i]:b[i + 1]], (r + 1) % n, 4)]
        MPI.Request.Waitall(reqs)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))
