"""free_params that keeps the parameters' views in a global list before pointing them at
empty arrays: the gathered buffer stays alive, FSDP frees nothing."""
import numpy as np

KEPT = []


def free_params(group):
    KEPT.append([p.data for p in group.params])
    for p in group.params:
        p.data = np.empty(0, group.dtype)
