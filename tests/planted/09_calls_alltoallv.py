"""all_to_all_v with MPI's own Alltoallv: the exercise is to build it from point-to-point
messages, so the grader refuses the call."""
import numpy as np

EXPECT = {"9.2": "called comm.Alltoall"}


def all_to_all_v(comm, send_chunks):
    n = comm.Get_size()
    counts = np.array([len(c) for c in send_chunks], np.int64)
    got = np.empty(n, np.int64)
    comm.Alltoall(counts, got)
    flat = np.concatenate([c.reshape(len(c), -1) for c in send_chunks])
    out = np.empty((int(got.sum()), flat.shape[1]), flat.dtype)
    comm.Alltoallv([flat, counts * flat.shape[1]], [out, got * flat.shape[1]])
    return np.split(out, np.cumsum(got)[:-1])
