"""ring_pass_start built on comm.Alltoall (a message to every rank, empty but for the right
neighbour's): a collective where the ring step is point-to-point."""
import numpy as np

EXPECT = {"13.3": "called comm.Alltoall"}
TIMEOUT = 3


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    for a, b in zip(send_arrays, recv_arrays):
        out = np.zeros((n, a.size), a.dtype)
        out[(r + 1) % n] = a.reshape(-1)
        into = np.empty_like(out)
        comm.Alltoall(out, into)
        b.reshape(-1)[...] = into[(r - 1) % n]
    return []
