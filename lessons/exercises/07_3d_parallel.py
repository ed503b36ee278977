"""Exercise 07: where each rank sits in 3D parallelism.

A job of tp x pp x dp ranks lays them out with tp varying fastest (a tensor-parallel
group is neighbouring ranks: on a cluster, one node's GPUs), then pp, then dp. Every
group a rank talks to follows from its coordinates. Replace each `raise` with your code,
then grade your file under MPI at 4 ranks:

    mpirun -n 4 python -m minidist.grade lessons/exercises/07_3d_parallel.py

The checks themselves are serial (every rank tries many factorisations of many world
sizes, and checks that the results returned earlier stay as they were); then lesson 07
runs on the 4 ranks with your grid_coords building its ProcessGrid (tp 2 x pp 2 in
float64, tp 2 x dp 2 in float32). The package's answers are in minidist/comm/grid.py
under the same names.
"""


def grid_coords(rank, tp, pp, dp):
    """(dp_rank, pp_rank, tp_rank) of world rank `rank` on a tp x pp x dp grid.

    tp varies fastest, dp slowest: rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank.
    Example: tp=2, pp=2, dp=2: rank 5 -> (1, 0, 1); rank 6 -> (1, 1, 0). Integers (// and
    %), not floats such as 1.0.
    """
    raise NotImplementedError("exercise 7.1: grid_coords")


def grid_group(rank, kind, tp, pp, dp):
    """The world ranks in `rank`'s group of `kind` ("tp", "pp" or "dp"), as a list in the
    group's own rank order (its kind's coordinate 0, 1, 2, ...).

    The members share every coordinate with `rank` except the one of `kind`.
    Example: tp=2, pp=2, dp=2, rank 5: "tp" -> [4, 5], "pp" -> [5, 7], "dp" -> [1, 5].
    Integer members, in a new list each call (not a set, not a generator). Any other
    kind is a ValueError (raised, not an assert).
    """
    raise NotImplementedError("exercise 7.2: grid_group")
