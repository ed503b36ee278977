"""ring_pass_start with blocking calls: every rank Sends to the right, then Receives from the
left. Every rank sends first, so none receives: a deadlock (MPI buffers small messages, so
it may seem to work until K and V grow; the grader's Send waits for its Recv at any size)."""

EXPECT = {"13.3": "did not finish within"}
TIMEOUT = 3
DEADLOCK = True


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    for a, b in zip(send_arrays, recv_arrays):
        comm.Send(a, (r + 1) % n, tag)
        comm.Recv(b, (r - 1) % n, tag)
    return []
