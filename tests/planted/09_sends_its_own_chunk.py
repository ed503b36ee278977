"""all_to_all_v that loops over every rank, itself included, and sends its own chunk
through MPI (to itself) instead of copying it: right rows, more bytes than the formula."""
import numpy as np

EXPECT = {"9.2": "your own chunk went through MPI: copy it instead"}


def all_to_all_v(comm, send_chunks):
    n, r = comm.Get_size(), comm.Get_rank()
    counts = np.zeros(n, np.int64)
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        comm.Sendrecv(np.array([len(send_chunks[to])], np.int64), to, 0, counts[frm:frm + 1], frm, 0)
    counts[r] = len(send_chunks[r])
    out = [None] * n
    for k in range(n):                     # k = 0: to myself, through MPI
        to, frm = (r + k) % n, (r - k) % n
        out[frm] = np.empty((int(counts[frm]),) + send_chunks[r].shape[1:], send_chunks[r].dtype)
        comm.Sendrecv(np.ascontiguousarray(send_chunks[to]), to, 1, out[frm], frm, 1)
    return out
