"""Checks for lessons/exercises/07_3d_parallel.py: the 3D rank coordinates, serial.

Every factorisation tp x pp x dp of every world size from 1 to 24 (and the seed's
1024 = 8 x 8 x 16), every rank: the coordinates must be in range, turn back into the
rank, and put tp fastest; every group must hold the ranks that share all coordinates but
its own, in that coordinate's order, and the three groups of a rank must meet only in
the rank itself. Coordinates and members are integers (Python's or NumPy's), not floats
such as 2.0; a group is a list or tuple, not a set. The expected values are computed here
from the layout's definition (rank = d pp tp + p tp + t), not from the package, so the
check stands on its own.
"""
import numbers

from minidist.comm import grid
from minidist.grader.checks import Exercise


def factorisations(n):
    return [(t, p, n // (t * p)) for t in range(1, n + 1) if n % t == 0
            for p in range(1, n // t + 1) if (n // t) % p == 0]


def _grids():
    out = [f for n in range(1, 25) for f in factorisations(n)]
    return out + [(8, 8, 16)]


def _ranks(tp, pp, dp):
    n = tp * pp * dp
    return range(n) if n <= 64 else sorted({0, 1, 7, 8, 63, 64, 513, n - 1})


def _integers(call, got, what):
    """Ranks and coordinates are integers: a float (3.0, from / and floor) is no rank to index or send to."""
    try:
        items = list(got)
    except TypeError:
        raise AssertionError(f"{call} returned {got!r}; expected a sequence of integers") from None
    bad = [x for x in items if not isinstance(x, numbers.Integral) or isinstance(x, bool)]
    if bad:
        raise AssertionError(f"{call} returned ({', '.join(map(str, items))}): {what} are integers, not "
                             f"{type(bad[0]).__name__} (use // and %, not / and floor)")


def check_coords(fn):
    for tp, pp, dp in _grids():
        for r in _ranks(tp, pp, dp):
            got = fn(r, tp, pp, dp)
            want = (r // (tp * pp), (r // tp) % pp, r % tp)
            _integers(f"grid_coords({r}, tp={tp}, pp={pp}, dp={dp})", got, "coordinates")
            if tuple(got) != want:
                raise AssertionError(f"grid_coords({r}, tp={tp}, pp={pp}, dp={dp}) returned {tuple(got)}, "
                                     f"expected (dp, pp, tp) = {want}: tp varies fastest, "
                                     f"rank = dp_rank*(pp*tp) + pp_rank*tp + tp_rank")


def check_group(fn):
    for tp, pp, dp in _grids():
        for r in _ranks(tp, pp, dp):
            d, p, t = r // (tp * pp), (r // tp) % pp, r % tp
            want = {"tp": [d * pp * tp + p * tp + i for i in range(tp)],
                    "pp": [d * pp * tp + i * tp + t for i in range(pp)],
                    "dp": [i * pp * tp + p * tp + t for i in range(dp)]}
            for kind, w in want.items():
                got = fn(r, kind, tp, pp, dp)
                call = f"grid_group({r}, {kind!r}, tp={tp}, pp={pp}, dp={dp})"
                if isinstance(got, (set, frozenset, dict)):
                    raise AssertionError(f"{call} returned a {type(got).__name__}: a group is ordered, list its "
                                         f"members in {kind}_rank order")
                _integers(call, got, "group members")
                got = list(got)
                if got != w:
                    raise AssertionError(f"grid_group({r}, {kind!r}, tp={tp}, pp={pp}, dp={dp}) returned {got}, "
                                         f"expected {w}: the ranks that share every coordinate but {kind}'s, "
                                         f"in {kind}_rank order")
    try:
        fn(0, "ep", 1, 1, 1)
    except ValueError:
        return
    raise AssertionError("grid_group(0, 'ep', 1, 1, 1) returned instead of raising ValueError: "
                         "an unknown kind is an error")


EXERCISES = [
    Exercise("7.1", "grid_coords", grid.grid_coords, check_coords),
    Exercise("7.2", "grid_group", grid.grid_group, check_group),
]
