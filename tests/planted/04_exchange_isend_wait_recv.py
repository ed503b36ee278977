"""exchange that sends first and waits for its Isend before receiving: fine in a line, but two
neighbours exchanging towards each other (1F1B's steady state) each wait for the other's
receive; past MPI's eager limit (lesson 04's activations) that is a deadlock."""
import numpy as np

EXPECT = {"4.3": "waited for its Isend to rank"}
RANKS = 3


def exchange(comm, send=None, recv=None):
    got = req = None
    if send is not None:
        req = comm.Isend(send[0], send[1], send[2])
        req.Wait()                                  # the bug: the neighbour is doing the same
    if recv is not None:
        shape, dtype, source, tag = recv
        got = np.empty(shape, dtype)
        comm.Recv(got, source, tag)
    return got, req
