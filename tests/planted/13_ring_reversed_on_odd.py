"""ring_pass_start that turns the ring the other way on odd ranks (send to rank-1, receive
from rank+1): at 2 ranks that is the same neighbour, from 3 the messages never meet."""

EXPECT = {"13.3": "the ring turned the wrong way"}
TIMEOUT = 3


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    step = -1 if r % 2 else 1
    reqs = []
    for a, b in zip(send_arrays, recv_arrays):
        reqs += [comm.Irecv(b, (r - step) % n, tag), comm.Isend(a, (r + step) % n, tag)]
    return reqs
