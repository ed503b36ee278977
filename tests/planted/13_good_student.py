"""A right answer to all three, written as a student would: np.logaddexp with the -inf rows
guarded, the chunks from the rule, Isend/Irecv returned unwaited. The grader must PASS it,
lesson 13 with each function plugged into the package included."""
import numpy as np

EXPECT = {"13.1": None, "13.2": None, "13.3": None}
TIMEOUT = 3


def merge_partials(o1, lse1, o2, lse2):
    lse = np.logaddexp(lse1, lse2)
    finite = np.isfinite(lse)
    ref = np.where(finite, lse, 0)
    w1 = np.where(finite, np.exp(lse1 - ref), 0)
    w2 = np.where(finite, np.exp(lse2 - ref), 0)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


def rank_chunks(rank, cp, load_balance=True):
    if load_balance:
        return [rank, 2 * cp - 1 - rank]
    return [2 * rank, 2 * rank + 1]


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    requests = []
    for a, b in zip(send_arrays, recv_arrays):
        requests.append(comm.Irecv(b, (r - 1) % n, tag))
        requests.append(comm.Isend(a, (r + 1) % n, tag))
    return requests
