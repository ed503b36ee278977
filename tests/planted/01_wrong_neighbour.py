"""Planted bug: receives from the right neighbour instead of the left. At 2 ranks left and
right are the same rank and it passes; at 3 every rank waits for a message that never comes."""
import numpy as np



def ring_reduce_scatter(comm, x, op="sum", axis=0):
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    chunks = [c.copy() for c in np.array_split(rows, n)]
    right = (r + 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r - s - 1) % n, (r - s - 2) % n
        recv = np.empty_like(chunks[recv_c])
        comm.Sendrecv(chunks[send_c], right, 0, recv, right, 0)     # should receive from (r - 1) % n
        chunks[recv_c] = np.maximum(chunks[recv_c], recv) if op == "max" else chunks[recv_c] + recv
    mine = chunks[r] / n if op == "avg" else chunks[r]
    return np.ascontiguousarray(np.moveaxis(mine, 0, axis))
