"""Planted exercise-07 bug: pp varies fastest instead of tp (the groups follow from it)."""


def grid_coords(rank, tp, pp, dp):
    return rank // (pp * tp), rank % pp, (rank // pp) % tp


def grid_group(rank, kind, tp, pp, dp):
    d, p, t = grid_coords(rank, tp, pp, dp)
    at = lambda d, p, t: d * pp * tp + t * pp + p      # noqa: E731
    return {"tp": [at(d, p, i) for i in range(tp)], "pp": [at(d, i, t) for i in range(pp)],
            "dp": [at(i, p, t) for i in range(dp)]}[kind]
