"""ring_pass_start that sends everything with tag 0: two exchanges in flight at once (K, V
and dK, dV) can take each other's messages."""

EXPECT = {"13.3": "use the tag given"}
TIMEOUT = 3


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    reqs = []
    for a, b in zip(send_arrays, recv_arrays):
        reqs += [comm.Irecv(b, (r - 1) % n, 0), comm.Isend(a, (r + 1) % n, 0)]
    return reqs
