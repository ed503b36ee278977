"""ring_pass_start that sends two ranks on, to rank+2."""

EXPECT = {"13.3": "the ring sends to the right neighbour, (rank + 1) % n"}
TIMEOUT = 3


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    reqs = []
    for a, b in zip(send_arrays, recv_arrays):
        reqs += [comm.Irecv(b, (r - 1) % n, tag), comm.Isend(a, (r + 2) % n, tag)]
    return reqs
