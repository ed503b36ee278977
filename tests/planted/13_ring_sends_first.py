"""ring_pass_start that returns its requests as [all the sends, then all the receives]: the
ring's backward takes requests[0::2] for the receives of dK, dV and adds them before they
have arrived (a mixed-up list, the right messages)."""

EXPECT = {"13.3": "return them as [recv[0], send[0], recv[1], send[1], ...]"}
TIMEOUT = 3


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    reqs = [comm.Isend(a, (r + 1) % n, tag) for a in send_arrays]
    reqs += [comm.Irecv(b, (r - 1) % n, tag) for b in recv_arrays]
    return reqs
