"""exchange receiving into one buffer kept per shape and dtype: the next message of that
shape overwrites the array the last call returned, which the pipeline still uses (a
forward's input, saved for its backward)."""
import numpy as np

EXPECT = {"4.3": "receive into a new array on every call"}
RANKS = 3

_BUFFERS = {}


def exchange(comm, send=None, recv=None):
    got = rreq = sreq = None
    if recv is not None:
        shape, dtype, source, tag = recv
        key = (tuple(shape), np.dtype(dtype))
        if key not in _BUFFERS:
            _BUFFERS[key] = np.empty(shape, dtype)
        got = _BUFFERS[key]
        rreq = comm.Irecv(got, source, tag)
    if send is not None:
        sreq = comm.Isend(send[0], send[1], send[2])
    if rreq is not None:
        rreq.Wait()
    return got, sreq
