"""grid_group that returns a generator expression instead of a list: the members can be
read once, and the group is no list to index, count or read again."""

EXPECT = {"7.2": "returned a generator; a list of the group's world ranks is expected"}
RANKS = 4


def grid_group(rank, kind, tp, pp, dp):
    d, p, t = rank // (tp * pp), (rank // tp) % pp, rank % tp
    if kind == "tp":
        return (d * pp * tp + p * tp + i for i in range(tp))
    if kind == "pp":
        return (d * pp * tp + i * tp + t for i in range(pp))
    if kind == "dp":
        return (i * pp * tp + p * tp + t for i in range(dp))
    raise ValueError(f"unknown kind {kind!r}")
