"""Output buffers kept between calls: average_gradients divides into one array per shape
and dtype (two parameters of one shape, LayerNorm's weight and bias, would share it), and
assign_buckets appends to one module-level list that it empties on every call."""
import numpy as np

from minidist.comm import ring_all_reduce

EXPECT = {"2.1": "changed when it was called again with other gradients",
          "2.2": "changed when it was called again"}
RANKS = 3
_OUT = {}
_BUCKETS = []


def average_gradients(comm, grads):
    out = []
    for g in grads:
        buf = _OUT.setdefault((g.shape, g.dtype), np.empty_like(g))
        np.divide(ring_all_reduce(comm, g, op="sum"), comm.Get_size(), out=buf)
        out.append(buf)
    return out


def assign_buckets(nbytes, bucket_bytes):
    _BUCKETS.clear()
    group, size = [], 0
    for i in reversed(range(len(nbytes))):
        group.append(i)
        size += nbytes[i]
        if size >= bucket_bytes:
            _BUCKETS.append(group)
            group, size = [], 0
    if group:
        _BUCKETS.append(group)
    return _BUCKETS
