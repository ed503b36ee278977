"""grid_group that fills one list kept between calls (to save allocations): every group
it returned earlier changes when it is called again."""

EXPECT = {"7.2": "when grid_group was called again with other arguments: return a new list each call"}
RANKS = 4
MEMBERS = []


def grid_group(rank, kind, tp, pp, dp):
    d, p, t = rank // (tp * pp), (rank // tp) % pp, rank % tp
    at = {"tp": lambda i: d * pp * tp + p * tp + i, "pp": lambda i: d * pp * tp + i * tp + t,
          "dp": lambda i: i * pp * tp + p * tp + t}
    if kind not in at:
        raise ValueError(f"unknown kind {kind!r}")
    MEMBERS.clear()
    MEMBERS.extend(at[kind](i) for i in range({"tp": tp, "pp": pp, "dp": dp}[kind]))
    return MEMBERS
