"""ring_reduce_scatter keeping its work buffer between calls (one per shape and dtype, to
save the copy's allocation) and returning its chunk as a view of it: the next call with
an input of the same shape rewrites the chunk the last call returned."""
import numpy as np
from mpi4py import MPI

EXPECT = {"1.1": "changed when it was called again"}
RANKS = 3
_ACC = {}


def _bounds(n, size):
    q, r = divmod(n, size)
    return [c * q + min(c, r) for c in range(size + 1)]


def ring_reduce_scatter(comm, x, op="sum", axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    b = _bounds(rows.shape[0], n)
    acc = _ACC.setdefault((rows.shape, rows.dtype, n), np.empty_like(rows))
    acc[...] = rows
    combine = np.maximum if op == "max" else np.add
    for s in range(n - 1):
        send_c, recv_c = (r - s - 1) % n, (r - s - 2) % n
        recv = np.empty_like(acc[b[recv_c]:b[recv_c + 1]])
        reqs = [comm.Irecv(recv, (r - 1) % n, 7), comm.Isend(acc[b[send_c]:b[send_c + 1]], (r + 1) % n, 7)]
        MPI.Request.Waitall(reqs)
        combine(acc[b[recv_c]:b[recv_c + 1]], recv, out=acc[b[recv_c]:b[recv_c + 1]])
    mine = acc[b[r]:b[r + 1]]
    if op == "avg":
        mine /= n
    return np.moveaxis(mine, 0, axis)
