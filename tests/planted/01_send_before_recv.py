"""Planted bug: every rank Sends before it Recvs. With small arrays the sends are eager and it
works; above the eager limit every Send waits for a Recv that comes after it: a deadlock."""
import numpy as np

from minidist.comm.collectives import ring_all_gather, ring_all_reduce  # noqa: F401  (must PASS after the deadlock)


def ring_reduce_scatter(comm, x, op="sum", axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    chunks = [c.copy() for c in np.array_split(rows, n)]
    for s in range(n - 1):
        send_c, recv_c = (r - s - 1) % n, (r - s - 2) % n
        recv = np.empty_like(chunks[recv_c])
        comm.Send(chunks[send_c], (r + 1) % n, 0)
        comm.Recv(recv, (r - 1) % n, 0)
        chunks[recv_c] = np.maximum(chunks[recv_c], recv) if op == "max" else chunks[recv_c] + recv
    mine = chunks[r] / n if op == "avg" else chunks[r]
    return np.ascontiguousarray(np.moveaxis(mine, 0, axis))
