"""exchange receiving from the send's destination with the send's tag (right when two
stages face each other with one tag, wrong in a ring or when tags differ)."""
import numpy as np


def exchange(comm, send=None, recv=None):
    got = rreq = sreq = None
    if recv is not None:
        shape, dtype, source, tag = recv
        if send is not None:
            source, tag = send[1], send[2]
        got = np.empty(shape, dtype)
        rreq = comm.Irecv(got, source, tag)
    if send is not None:
        sreq = comm.Isend(send[0], send[1], send[2])
    if rreq is not None:
        rreq.Wait()
    return got, sreq
