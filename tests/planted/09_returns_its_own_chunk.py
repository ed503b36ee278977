"""all_to_all_v that returns its own chunk as it is, send_chunks[r] itself, not a copy: the
right rows and bytes, but a caller that reuses its send buffer changes what it received."""
import numpy as np

EXPECT = {"9.2": "your own chunk returned as it is: copy it"}


def all_to_all_v(comm, send_chunks):
    n, r = comm.Get_size(), comm.Get_rank()
    counts = np.zeros(n, np.int64)
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        comm.Sendrecv(np.array([len(send_chunks[to])], np.int64), to, 0, counts[frm:frm + 1], frm, 0)
    out = [None] * n
    out[r] = send_chunks[r]                # not a copy
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        out[frm] = np.empty((int(counts[frm]),) + send_chunks[r].shape[1:], send_chunks[r].dtype)
        comm.Sendrecv(np.ascontiguousarray(send_chunks[to]), to, 1, out[frm], frm, 1)
    return out
