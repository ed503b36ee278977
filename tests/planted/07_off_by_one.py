"""Planted exercise-07 bug: the groups stop one member short (range(n - 1)); coordinates right."""


def grid_coords(rank, tp, pp, dp):
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def grid_group(rank, kind, tp, pp, dp):
    d, p, t = grid_coords(rank, tp, pp, dp)
    at = lambda d, p, t: d * pp * tp + p * tp + t      # noqa: E731
    if kind == "tp":
        return [at(d, p, i) for i in range(tp - 1)]
    if kind == "pp":
        return [at(d, i, t) for i in range(pp - 1)]
    if kind == "dp":
        return [at(i, p, t) for i in range(dp - 1)]
    raise ValueError(kind)
