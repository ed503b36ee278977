"""ring_pass_start that posts Isend and Irecv, then waits for them before returning: right
values, but the exchange no longer overlaps the compute, and a rank whose left neighbour
has not started its step waits for it."""
from mpi4py import MPI

EXPECT = {"13.3": "did not finish within"}
TIMEOUT = 3
DEADLOCK = True


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    n, r = comm.Get_size(), comm.Get_rank()
    reqs = []
    for a, b in zip(send_arrays, recv_arrays):
        reqs += [comm.Irecv(b, (r - 1) % n, tag), comm.Isend(a, (r + 1) % n, tag)]
    MPI.Request.Waitall(reqs)
    return reqs
