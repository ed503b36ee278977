"""Planted bugs: MPI's own Allreduce instead of the ring; the last, partial bucket dropped."""
import numpy as np
from mpi4py import MPI


def average_gradients(comm, grads):
    out = []
    for g in grads:
        total = np.empty_like(g)
        comm.Allreduce(g, total, op=MPI.SUM)
        out.append(total / comm.Get_size())
    return out


def assign_buckets(nbytes, bucket_bytes):
    buckets, open_bucket, size = [], [], 0
    for i in range(len(nbytes) - 1, -1, -1):
        open_bucket.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            buckets.append(open_bucket)
            open_bucket, size = [], 0
    return buckets
