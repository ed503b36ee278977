"""Checks for lessons/exercises/07_3d_parallel.py: the 3D rank coordinates.

The unit checks are serial (every rank of the job runs them alike). Every factorisation
tp x pp x dp of every world size from 1 to 24 (and 1024 = 8 x 8 x 16, lesson 07's worked
example), every rank: the coordinates must be in range, turn back into the rank, and put tp
fastest; every group must hold the ranks that share all coordinates but its own, in that
coordinate's order. Coordinates and members are integers (Python's or NumPy's), not
floats such as 2.0; coordinates are a tuple (or list), a group a list (or tuple): not a
set, not a generator. After all the calls, every result returned earlier must still be
what it was (a list reused and refilled would not be).

The expected values are computed here from the layout's definition (rank = d pp tp +
p tp + t), not from the package, so the check stands on its own; and only after the
function under grade has returned, in a helper's frame that is gone by the next call:
nothing the student's code could read from the stack while it runs holds them.

The plug-in check (7.1): lesson 07 on 4 ranks, tp 2 x pp 2 and tp 2 x dp 2, its
ProcessGrid built with your grid_coords; exercise 07 is graded under mpirun -n 4. The
package's answer of 7.2 is called by ProcessGrid's tp_group/pp_group/dp_group and its
printed table only, which no lesson uses: 7.2 has unit checks alone.
"""
import numbers
import types

from minidist.comm import grid
from minidist.grader.checks import Exercise, yours as _yours
from minidist.grader.plugin import Run
from minidist.grader.referee import where


def factorisations(n):
    return [(t, p, n // (t * p)) for t in range(1, n + 1) if n % t == 0
            for p in range(1, n // t + 1) if (n // t) % p == 0]


def _grids():
    out = [f for n in range(1, 25) for f in factorisations(n)]
    return out + [(8, 8, 16)]


def _ranks(tp, pp, dp):
    n = tp * pp * dp
    return range(n) if n <= 64 else sorted({0, 1, 7, 8, 63, 64, 513, n - 1})


def _sequence(call, got, what):
    """The result as a list, or a sentence: a list or tuple is expected (an array for coordinates)."""
    if isinstance(got, types.GeneratorType) or hasattr(got, "__next__"):
        kind = "a generator" if isinstance(got, types.GeneratorType) else f"an iterator ({type(got).__name__})"
        raise AssertionError(f"{call} returned {kind}; {what} expected (a generator is used up once read: "
                             "build the list, e.g. [... for i in range(n)])")
    if isinstance(got, range):
        raise AssertionError(f"{call} returned {got!r}; {what} expected (list({got!r}))")
    if isinstance(got, (set, frozenset, dict)):
        raise AssertionError(f"{call} returned a {type(got).__name__}: a group is ordered, list its members in "
                             "rank order" if "group" in what else
                             f"{call} returned a {type(got).__name__}; {what} expected")
    try:
        return list(got)
    except TypeError:
        raise AssertionError(f"{call} returned {got!r}; {what} expected") from None


def _integers(call, items, what):
    """Ranks and coordinates are integers: a float (3.0, from / and floor) is no rank to index or send to."""
    bad = [x for x in items if not isinstance(x, numbers.Integral) or isinstance(x, bool)]
    if bad:
        raise AssertionError(f"{call} returned ({', '.join(map(str, items))}): {what} are integers, not "
                             f"{type(bad[0]).__name__} (use // and %, not / and floor)")


def _expected_coords(r, tp, pp, dp):
    return r // (tp * pp), (r // tp) % pp, r % tp


def _expected_group(r, kind, tp, pp, dp):
    d, p, t = _expected_coords(r, tp, pp, dp)
    if kind == "tp":
        return [d * pp * tp + p * tp + i for i in range(tp)]
    if kind == "pp":
        return [d * pp * tp + i * tp + t for i in range(pp)]
    return [i * pp * tp + p * tp + t for i in range(dp)]


def _coords_ok(got, r, tp, pp, dp):
    """Called after the student's grid_coords returned: the expected value exists only here."""
    call = f"grid_coords({r}, tp={tp}, pp={pp}, dp={dp})"
    items = _sequence(call, got, "a tuple (dp_rank, pp_rank, tp_rank) is")
    _integers(call, items, "coordinates")
    want = _expected_coords(r, tp, pp, dp)
    if tuple(items) != want:
        raise AssertionError(f"{call} returned {tuple(items)}, expected (dp, pp, tp) = {want}: tp varies fastest, "
                             f"rank = dp_rank*(pp*tp) + pp_rank*tp + tp_rank")
    return tuple(items)


def _group_ok(got, r, kind, tp, pp, dp):
    """Called after the student's grid_group returned: the expected value exists only here."""
    call = f"grid_group({r}, {kind!r}, tp={tp}, pp={pp}, dp={dp})"
    items = _sequence(call, got, "a list of the group's world ranks is")
    _integers(call, items, "group members")
    want = _expected_group(r, kind, tp, pp, dp)
    if items != want:
        raise AssertionError(f"{call} returned {items}, expected {want}: the ranks that share every coordinate "
                             f"but {kind}'s, in {kind}_rank order")
    return items


def _unchanged(returned, name):
    """Every earlier result still as it was when it was checked."""
    for args, got, seen in returned:
        now = list(got) if isinstance(got, (list, tuple)) or hasattr(got, "__array__") else got
        if now != list(seen):
            call = f"{name}({', '.join(map(repr, args))})"
            raise AssertionError(f"{call} returned {list(seen)}, which became {now} when {name} was called again "
                                 "with other arguments: return a new list each call, not one kept and refilled")


def check_coords(fn):
    returned = []
    for tp, pp, dp in _grids():
        for r in _ranks(tp, pp, dp):
            got = _yours(fn, r, tp, pp, dp)
            returned.append(((r, tp, pp, dp), got, _coords_ok(got, r, tp, pp, dp)))
    _unchanged(returned, "grid_coords")


def check_group(fn):
    returned = []
    for tp, pp, dp in _grids():
        for r in _ranks(tp, pp, dp):
            for kind in ("tp", "pp", "dp"):
                got = _yours(fn, r, kind, tp, pp, dp)
                returned.append(((r, kind, tp, pp, dp), got, _group_ok(got, r, kind, tp, pp, dp)))
    _unchanged(returned, "grid_group")
    try:
        fn(0, "ep", 1, 1, 1)
    except ValueError:
        return
    except AssertionError as e:
        raise AssertionError(f"grid_group(0, 'ep', 1, 1, 1): your code's assert failed"
                             f"{': ' + str(e) if str(e) else ''}{where(e)}; an unknown kind is a ValueError "
                             "(raise ValueError(...), not assert)") from None
    raise AssertionError("grid_group(0, 'ep', 1, 1, 1) returned instead of raising ValueError: "
                         "an unknown kind is an error")


# Lesson 07 on the job's first 4 ranks, its ProcessGrid built with your grid_coords (7.1) or
# grid_group (7.2: its lists become the grid's communicators): tp 2 x pp 2 (a pipeline of
# two tensor-parallel stages) in float64, tp 2 x dp 2 (two replicas) in float32. (One dtype
# each: the coordinates do not depend on it, and a lesson run on 4 ranks is the slowest
# part of grading 07.)
SMALL = ("--n-layer", "2", "--n-head", "2", "--n-embd", "8", "--block-size", "4", "--batch-size", "4", "--steps", "1")
RUNS = (Run("07_3d_parallel", ("--tp", "2", "--pp", "2") + SMALL, ranks=4, dtypes=("float64",)),
        Run("07_3d_parallel", ("--tp", "2", "--dp", "2") + SMALL, ranks=4, dtypes=("float32",)))

EXERCISES = [
    Exercise("7.1", "grid_coords", grid.grid_coords, check_coords, runs=RUNS),
    Exercise("7.2", "grid_group", grid.grid_group, check_group, runs=RUNS),
]
