"""all_to_all_v that keeps one receive buffer per source between calls (to save
allocations) and returns views of it: the next call overwrites the rows the last one
returned, which the MoE layer still needs for its backward."""
import numpy as np

EXPECT = {"9.2": "changed when it was called again"}
_BUF = {}


def all_to_all_v(comm, send_chunks):
    n, r = comm.Get_size(), comm.Get_rank()
    counts = np.zeros(n, np.int64)
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        comm.Sendrecv(np.array([len(send_chunks[to])], np.int64), to, 0, counts[frm:frm + 1], frm, 0)
    out = [None] * n
    out[r] = send_chunks[r].copy()
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        shape = (int(counts[frm]),) + send_chunks[r].shape[1:]
        buf = _BUF.get((frm, send_chunks[r].dtype.str, shape[1:]))
        if buf is None or buf.size < int(np.prod(shape)):
            buf = _BUF[(frm, send_chunks[r].dtype.str, shape[1:])] = np.empty(max(int(np.prod(shape)), 1) * 2,
                                                                            send_chunks[r].dtype)
        view = buf[:int(np.prod(shape))].reshape(shape)
        comm.Sendrecv(np.ascontiguousarray(send_chunks[to]), to, 1, view, frm, 1)
        out[frm] = view
    return out
