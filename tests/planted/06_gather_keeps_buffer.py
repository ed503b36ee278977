"""gather_params that also keeps the gathered buffer on the group (group.full = full):
free_params frees the parameters, but the buffer stays alive."""
from minidist.comm import ring_all_gather


def gather_params(comm, group):
    full = ring_all_gather(comm, group.shard)
    group.point(full)
    group.full = full
    return full
