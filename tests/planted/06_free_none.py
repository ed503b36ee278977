"""free_params that sets every parameter's data to None: the buffer goes, but a freed
parameter is no array any more (the model reads its shape and dtype)."""

EXPECT = {"6.2": "fc.weight.data is None, not an array: point it at an empty array of the unit's dtype"}
RANKS = 3


def free_params(group):
    for p in group.params:
        p.data = None
