"""Planted bug: the all-gather runs N steps instead of N-1. The result is right (the last step
brings each rank its own piece back), but each rank sends M instead of (N-1)/N M."""
import numpy as np
from mpi4py import MPI



def ring_all_gather(comm, x, axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    lengths = np.zeros(n, np.int64)
    mine = np.array([rows.shape[0]], np.int64)
    sends = [comm.Isend(mine, k, 1) for k in range(n) if k != r]     # lengths: to everyone
    for k in range(n):
        if k != r:
            comm.Recv(lengths[k:k + 1], k, 1)
    MPI.Request.Waitall(sends)
    lengths[r] = rows.shape[0]
    b = np.concatenate([[0], np.cumsum(lengths)])
    out = np.empty((int(b[-1]),) + rows.shape[1:], x.dtype)
    out[b[r]:b[r + 1]] = rows
    for s in range(n):                                   # one step too many
        i, j = (r - s) % n, (r - s - 1) % n
        comm.Sendrecv(out[b[i]:b[i + 1]].copy(), (r + 1) % n, 2, out[b[j]:b[j + 1]], (r - 1) % n, 2)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))
