"""ring_pass_start with the lower-case isend/irecv, which pickle Python objects (slow, and
the receive does not land in the caller's buffer)."""

EXPECT = {"13.3": "which pickles Python objects"}
TIMEOUT = 3


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    reqs = [comm.isend(a, (r + 1) % n, tag) for a in send_arrays]
    reqs += [comm.irecv(source=(r - 1) % n, tag=tag) for _ in recv_arrays]
    return reqs
