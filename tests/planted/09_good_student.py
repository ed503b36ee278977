"""A right answer to both, written as a student would: the grader must PASS it, the
plug-in runs of lesson 09 included."""
import numpy as np

EXPECT = {"9.1": None, "9.2": None}
RANKS = 3


def route(probs, top_k, capacity):
    T, E = probs.shape
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(np.int64)
    keep = np.ones((T, top_k), dtype=bool)
    if capacity is not None:
        for e in range(E):
            tok, slot = np.nonzero(experts == e)
            order = np.lexsort((tok, -probs[tok, e]))
            keep[tok[order[capacity:]], slot[order[capacity:]]] = False
    return experts, keep


def all_to_all_v(comm, send_chunks):
    n, r = comm.Get_size(), comm.Get_rank()
    chunks = [np.ascontiguousarray(c) for c in send_chunks]
    counts = np.zeros(n, np.int64)
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        comm.Sendrecv(np.array([len(chunks[to])], np.int64), to, 0, counts[frm:frm + 1], frm, 0)
    out = [None] * n
    out[r] = chunks[r].copy()
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        out[frm] = np.empty((int(counts[frm]),) + chunks[r].shape[1:], chunks[r].dtype)
        comm.Sendrecv(chunks[to], to, 1, out[frm], frm, 1)
    return out
