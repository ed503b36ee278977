"""Planted bugs: divides the caller's gradients in place; buckets in forward order."""
from minidist.comm import ring_all_reduce


def average_gradients(comm, grads):
    for g in grads:
        g /= comm.Get_size()
    return [ring_all_reduce(comm, g, op="sum") for g in grads]


def assign_buckets(nbytes, bucket_bytes):
    buckets, open_bucket, size = [], [], 0
    for i in range(len(nbytes)):
        open_bucket.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            buckets.append(open_bucket)
            open_bucket, size = [], 0
    return buckets + [open_bucket] if open_bucket else buckets
