"""exchange receiving into np.empty(shape): float64 whatever recv's dtype, so a float32
message lands as other numbers."""
import numpy as np


def exchange(comm, send=None, recv=None):
    got = rreq = sreq = None
    if recv is not None:
        shape, dtype, source, tag = recv
        got = np.empty(shape)
        rreq = comm.Irecv(got, source, tag)
    if send is not None:
        sreq = comm.Isend(send[0], send[1], send[2])
    if rreq is not None:
        rreq.Wait()
    return got, sreq
