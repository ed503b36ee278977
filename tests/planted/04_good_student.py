"""Exercise 04 answered correctly, in a student's own words: every exercise PASSes."""
import numpy as np


def gpipe(p, m):
    one = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    return [list(one) for _ in range(p)]


def one_f_one_b(p, m):
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts, f, b = [("F", i, 0) for i in range(warm)], warm, 0
        while f < m:
            acts += [("F", f, 0), ("B", b, 0)]
            f, b = f + 1, b + 1
        out.append(acts + [("B", i, 0) for i in range(b, m)])
    return out


def exchange(comm, send=None, recv=None):
    got = rreq = sreq = None
    if recv is not None:
        shape, dtype, source, tag = recv
        got = np.empty(shape, dtype)
        rreq = comm.Irecv(got, source, tag)
    if send is not None:
        sreq = comm.Isend(send[0], send[1], send[2])
    if rreq is not None:
        rreq.Wait()
    return got, sreq
