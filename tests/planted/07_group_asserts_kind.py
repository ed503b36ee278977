"""grid_group that asserts the kind is known instead of raising ValueError: the student's
own assert fails on the unknown kind, and the verdict says it is theirs."""

EXPECT = {"7.2": "grid_group(0, 'ep', 1, 1, 1): your code's assert failed: kind must be tp, pp or dp"}
RANKS = 4


def grid_group(rank, kind, tp, pp, dp):
    assert kind in ("tp", "pp", "dp"), "kind must be tp, pp or dp"
    d, p, t = rank // (tp * pp), (rank // tp) % pp, rank % tp
    if kind == "tp":
        return [d * pp * tp + p * tp + i for i in range(tp)]
    if kind == "pp":
        return [d * pp * tp + i * tp + t for i in range(pp)]
    return [i * pp * tp + p * tp + t for i in range(dp)]
