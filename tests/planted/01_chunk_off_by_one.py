"""Planted bug: at step s sends chunk (r - s) instead of (r - s - 1): with uneven chunks the
receiver's buffer is the wrong length (MPI: "Message truncated")."""
import numpy as np



def ring_reduce_scatter(comm, x, op="sum", axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    chunks = [c.copy() for c in np.array_split(rows, n)]
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 2) % n                # off by one
        recv = np.empty_like(chunks[recv_c])
        comm.Sendrecv(chunks[send_c], (r + 1) % n, 0, recv, (r - 1) % n, 0)
        chunks[recv_c] = np.maximum(chunks[recv_c], recv) if op == "max" else chunks[recv_c] + recv
    mine = chunks[r] / n if op == "avg" else chunks[r]
    return np.ascontiguousarray(np.moveaxis(mine, 0, axis))
