"""grid_group returning a set: the right members, in no order."""


def grid_group(rank, kind, tp, pp, dp):
    d, p, t = rank // (tp * pp), (rank // tp) % pp, rank % tp
    at = lambda d, p, t: d * pp * tp + p * tp + t  # noqa: E731
    if kind == "tp":
        return {at(d, p, i) for i in range(tp)}
    if kind == "pp":
        return {at(d, i, t) for i in range(pp)}
    if kind == "dp":
        return {at(i, p, t) for i in range(dp)}
    raise ValueError(kind)
