"""A correct exercise-02 file in a student's style. Must PASS."""
from minidist.comm import ring_all_reduce


def average_gradients(comm, grads):
    n = comm.Get_size()
    return [ring_all_reduce(comm, g, op="sum") / n for g in grads]


def assign_buckets(nbytes, bucket_bytes):
    buckets, open_bucket, size = [], [], 0
    for i in range(len(nbytes) - 1, -1, -1):
        open_bucket.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            buckets.append(open_bucket)
            open_bucket, size = [], 0
    return buckets + [open_bucket] if open_bucket else buckets
