"""A student's own correct exercise-07 answers (written apart from the package's)."""


def grid_coords(rank, tp, pp, dp):
    tp_rank = rank % tp
    pp_rank = (rank // tp) % pp
    return rank // (tp * pp), pp_rank, tp_rank


def grid_group(rank, kind, tp, pp, dp):
    d, p, t = grid_coords(rank, tp, pp, dp)
    if kind == "tp":
        return [rank - t + i for i in range(tp)]
    if kind == "pp":
        return [rank + (i - p) * tp for i in range(pp)]
    if kind == "dp":
        return [rank + (i - d) * tp * pp for i in range(dp)]
    raise ValueError(f"unknown kind {kind}")
