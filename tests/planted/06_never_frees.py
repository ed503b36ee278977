"""Planted bug: free_params forgets to free (the gathered unit stays in memory)."""
from minidist.comm import ring_all_gather


def gather_params(comm, group):
    full = ring_all_gather(comm, group.shard)
    group.point(full)
    return full


def free_params(group):
    for p in group.params:
        p.grad = None
