"""free_params that frees the shard too: the parameters are pointed at an empty array,
and so is group.shard, from which the next gather is made (lesson 06 crashes there)."""
import numpy as np

EXPECT = {"6.2": "free_params changed group.shard"}
RANKS = 3


def free_params(group):
    empty = np.empty(0, group.dtype)
    for p in group.params:
        p.data = empty
    group.shard = empty
