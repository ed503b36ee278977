"""gather_params that allocates its buffer with np.zeros(group.n): float64 whatever the
unit's dtype, so a float32 unit's parameters become float64 views (lesson 06 at --dtype
float32 then MISMATCHes)."""
import numpy as np

from minidist.comm import ring_all_gather

EXPECT = {"6.1": "returned a float64 buffer: keep the unit's dtype float32"}
RANKS = 3


def gather_params(comm, group):
    full = np.zeros(group.n)
    full[:] = ring_all_gather(comm, group.shard)
    group.point(full)
    return full
