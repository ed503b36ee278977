"""exchange written for the forward pass only: it sends to rank r+1 and receives from rank
r-1 whatever send and recv say, so the gradients of the backward pass go the wrong way."""
import numpy as np

EXPECT = {"4.3": "activations go forward to the next stage, gradients back to the previous one"}
RANKS = 3


def exchange(comm, send=None, recv=None):
    rank, size = comm.Get_rank(), comm.Get_size()
    got = rreq = sreq = None
    if recv is not None:
        shape, dtype, _, tag = recv
        got = np.empty(shape, dtype)
        rreq = comm.Irecv(got, (rank - 1) % size, tag)      # the bug: recv's source ignored
    if send is not None:
        x, _, tag = send
        sreq = comm.Isend(x, (rank + 1) % size, tag)        # and send's dest
    if rreq is not None:
        rreq.Wait()
    return got, sreq
