"""Planted bug: the all-reduce works in float64 whatever the input's dtype, so a float32
array comes back as float64 (and the ring sends twice the bytes it needs)."""
import numpy as np


def ring_all_reduce(comm, x, op="sum"):
    n, r = comm.Get_size(), comm.Get_rank()
    flat = np.asarray(x, np.float64).reshape(-1)      # the bug: not x's own dtype
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(flat, n)])
    acc = flat.copy()
    part = lambda c: acc[bounds[c]:bounds[c + 1]]      # noqa: E731
    for s in range(n - 1):                             # reduce-scatter
        send, recv = (r - s - 1) % n, (r - s - 2) % n
        got = np.empty_like(part(recv))
        comm.Sendrecv(part(send).copy(), (r + 1) % n, 6, got, (r - 1) % n, 6)
        part(recv)[:] = np.maximum(got, part(recv)) if op == "max" else got + part(recv)
    if op == "avg":
        part(r)[:] /= n
    for s in range(n - 1):                             # all-gather
        send, recv = (r - s) % n, (r - s - 1) % n
        got = np.empty_like(part(recv))
        comm.Sendrecv(part(send).copy(), (r + 1) % n, 7, got, (r - 1) % n, 7)
        part(recv)[:] = got
    return acc.reshape(np.shape(x))
