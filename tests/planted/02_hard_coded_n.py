"""Planted bugs: divides by 4 (right at -n 4 only); rank 2 alone skips the all-reduce, so the
others wait for it; an endless loop in assign_buckets for an empty model."""
from minidist.comm import ring_all_reduce


def average_gradients(comm, grads):
    if comm.Get_size() == 3 and comm.Get_rank() == 2:
        return [g / 4 for g in grads]
    return [ring_all_reduce(comm, g, op="sum") / 4 for g in grads]


def assign_buckets(nbytes, bucket_bytes):
    buckets, open_bucket, size, i = [], [], 0, len(nbytes) - 1
    while i >= 0 or not buckets:
        if i < 0:
            continue                      # endless when nbytes is empty
        open_bucket.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            buckets.append(open_bucket)
            open_bucket, size = [], 0
        i -= 1
    return buckets + [open_bucket] if open_bucket else buckets
