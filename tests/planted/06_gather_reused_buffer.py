"""gather_params that keeps one buffer per unit size and fills it again on every call:
a second unit of the same size overwrites the first one's parameters (and the buffer is
never freed)."""
import numpy as np

from minidist.comm import ring_all_gather

EXPECT = {"6.1": "a new buffer per call, not one reused"}
RANKS = 3
BUFFERS = {}


def gather_params(comm, group):
    key = (group.n, group.dtype)
    if key not in BUFFERS:
        BUFFERS[key] = np.empty(group.n, group.dtype)
    full = BUFFERS[key]
    full[:] = ring_all_gather(comm, group.shard)
    group.point(full)
    return full
