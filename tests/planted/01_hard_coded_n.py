"""Planted bug: N written into the code (n = 3). Graded at 3 ranks the ring is right; on a
communicator of another size it sends to ranks that do not exist."""
import numpy as np


def ring_reduce_scatter(comm, x, op="sum", axis=0):
    n, r = 3, comm.Get_rank()                      # the bug: not comm.Get_size()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    chunks = [c.copy() for c in np.array_split(rows, n)]
    for s in range(n - 1):
        send, recv = (r - s - 1) % n, (r - s - 2) % n
        got = np.empty_like(chunks[recv])
        comm.Sendrecv(chunks[send], (r + 1) % n, 5, got, (r - 1) % n, 5)
        chunks[recv] = np.maximum(got, chunks[recv]) if op == "max" else got + chunks[recv]
    mine = chunks[r] / n if op == "avg" else chunks[r]
    return np.ascontiguousarray(np.moveaxis(mine, 0, axis))
