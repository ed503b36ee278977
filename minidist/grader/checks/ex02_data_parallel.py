"""Checks for lessons/exercises/02_data_parallel.py, run on every rank under mpirun.

average_gradients gets a CountingComm (minidist/grader/counting.py), which
refuses MPI's collectives: the mean must go through minidist's own ring_all_reduce
(which the check also sees in minidist.comm.stats). Every rank's gradients come from a
seed of that rank, so each rank computes the expected mean alone, with no messages, and
only after the function returned (while it runs, the check holds this rank's gradients
and nothing else); a check raises on the rank that sees the problem, and the grader
agrees the verdicts. The mean is checked in float64 and in float32 (the result keeps the
gradient's dtype: lesson 02 trains in both), three times on the whole world, twice with
gradients of the same shapes (the first call's result must be unchanged by the next:
lesson 02 keeps every averaged gradient as a parameter's .grad), then on sub-communicators
of another size (ranks 0 .. N-2 in one group, rank N-1 alone), so a divisor written into
the code (`/ 4`, right at -n 4) fails at every size: N must come from comm.Get_size().

assign_buckets is checked against the rule written out again (_buckets), on fixed and
random sizes, each result compared after the call and again after the later calls.

After a unit check passes, the plug-in check (minidist/grader/plugin.py) runs lesson 02
with the function in the package: average_gradients in its --naive run (NaiveDataParallel
averages with it after every backward), assign_buckets in its bucketed run with buckets
small enough that the model needs several.
"""
import numpy as np

from minidist.comm import stats
from minidist.grader.checks import Exercise, own_session
from minidist.grader.plugin import Run
from minidist.parallel import data_parallel

SHAPES = [(3, 4), (5,), (2, 2, 2), (1,), (0,), (7, 3)]
REFUSE = "use ring_all_reduce(comm, g, op=\"sum\"): this exercise averages with minidist's own ring"
# (seed, dtype) of the calls on the whole world: the first two have the same shapes and dtype
CALLS = [(100, np.float64), (200, np.float64), (300, np.float32)]
# float32: the sum of N float32 values in another order is off by a few 1e-7 of the largest
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}


def _grads(rank, seed=100, dtype=np.float64):
    rng = np.random.default_rng(seed + rank)  # every rank has its own gradients
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def _result(out, grads, me, where):
    """The function's result as a list of arrays, or AssertionError in words."""
    if not isinstance(out, (list, tuple)) or len(out) != len(grads):
        raise AssertionError(f"rank {me}{where}: expected a list of {len(grads)} arrays, got {type(out).__name__}"
                             + (f" of length {len(out)}" if hasattr(out, "__len__") else ""))
    return [np.asarray(o) for o in out]


def _check_mean(fn, s, members, where, seed=100, dtype=np.float64, kept=None):
    """Run fn on session s, whose ranks are the world ranks `members`, against their mean.
    kept: the results of earlier calls with copies, checked unchanged after this one."""
    rank, n = s.rank(), s.size()
    me = members[rank]
    grads = _grads(me, seed, dtype)
    before = [g.copy() for g in grads]
    comm = s.counting(REFUSE)
    with stats.measure() as m:
        out = fn(comm, grads)
    if comm.refused:
        raise AssertionError(comm.refused)
    out = _result(out, grads, me, where)
    for i, (g, b) in enumerate(zip(grads, before)):
        if not np.array_equal(g, b):
            raise AssertionError(f"rank {me}{where}: input gradient {i} was changed (g /= N changes the "
                                 "caller's array); return new arrays")
    what = f"{np.dtype(dtype).name} gradients"
    if kept is not None:
        kept.append((what, seed, out, [o.copy() for o in out]))
        for was, was_seed, arrays, copies in kept[:-1]:
            if any(not np.array_equal(a, c) for a, c in zip(arrays, copies)):
                raise AssertionError(f"rank {me}: the averages average_gradients returned for {was} (seed {was_seed}) "
                                     f"changed when it was called again with other gradients ({what}, seed {seed}): "
                                     "return new arrays on every call, not buffers kept between calls (each "
                                     "parameter keeps its averaged gradient)")
    everyone = [_grads(k, seed) for k in members]              # the answer, only now, in float64
    expected = [sum(gs[i] for gs in everyone) / n for i in range(len(SHAPES))]
    for i, (g, got, want) in enumerate(zip(grads, out, expected)):
        if got.shape != g.shape:
            raise AssertionError(f"rank {me}{where}: gradient {i} has shape {got.shape}, expected {g.shape}")
        if got.dtype != g.dtype:
            raise AssertionError(f"rank {me}{where}: gradient {i} is {got.dtype.name}, the gradients are "
                                 f"{g.dtype.name}: keep their dtype (a float64 buffer from np.zeros(shape), or "
                                 ".astype(float), doubles every message and every gradient's memory)")
        tol = TOL[np.dtype(dtype)]
        if want.size and np.max(np.abs(got - want)) > tol * max(float(np.max(np.abs(want))), 1.0):
            j = np.unravel_index(np.argmax(np.abs(got - want)), g.shape)
            k = round(float(want[j] * n / got[j])) if got[j] != 0 else 0      # the sum / k, k != N?
            by_k = n > 1 and 1 < k <= 1024 and k != n and np.allclose(got * k, want * n, rtol=1e-4)
            hint = (" (the sum: did you divide by N?)" if np.isclose(got[j], want[j] * n) else
                    f" (the sum divided by {k}, not by the {n} ranks: divide by comm.Get_size(), not by a "
                    "number written in the code)" if by_k else
                    " (this rank's own gradient: no message went out?)" if n > 1 and np.isclose(got[j], g[j]) else
                    " (divide by comm.Get_size(), not by a number written in the code)" if where else "")
            raise AssertionError(f"rank {me}{where}: gradient {i}{list(map(int, j))} ({what}) is {got[j]:.6f}, "
                                 f"expected the mean over {n} rank{'s' if n > 1 else ''} {want[j]:.6f}{hint}")
    if n > 1 and m.bytes_sent("all_reduce") == 0:
        raise AssertionError(f"rank {me}{where}: no bytes went through minidist's ring all-reduce; "
                             "use ring_all_reduce")


def check_average_gradients(fn, session=None):
    """On the whole world (float64 twice, then float32), then on groups of another size
    (ranks 0 .. N-2, and rank N-1 alone): a divisor written into the code (/ 4) is right
    at one size only."""
    with own_session(session, split=True) as s:
        kept = []
        for seed, dtype in CALLS:
            _check_mean(fn, s, list(range(s.size())), "", seed, dtype, kept)
        if s.sub is None:
            raise AssertionError("the check of exercise 2.1 needs the session's groups (Session(split=True))")
        g = s.group
        where = (f" in a group of {len(g)} ranks (world ranks {g[0]}..{g[-1]}, a communicator of size {len(g)})"
                 if len(g) > 1 else " alone in a communicator of size 1")
        _check_mean(fn, s.sub, g, where)


def _buckets(nbytes, cap):
    """The rule, written out again independently: a referee for assign_buckets."""
    out, cur, size = [], [], 0
    for i in range(len(nbytes) - 1, -1, -1):
        cur, size = cur + [i], size + nbytes[i]
        if size >= cap:
            out, cur, size = out + [cur], [], 0
    return out + ([cur] if cur else [])


def _plain(got):
    """The result as lists of ints (for comparing), or None when it is not a list of lists."""
    try:
        return [list(map(int, b)) for b in got]
    except TypeError:
        return None


def check_assign_buckets(fn):
    cases = [([100, 200, 50, 300], 250), ([10] * 7, 25), ([10] * 6, 30), ([5, 5, 5], 1),
             ([5, 5, 5], 10**6), ([], 100), ([400], 100), ([100, 200, 50, 300], 120)]
    rng = np.random.default_rng(0)
    cases += [(rng.integers(1, 1000, size=rng.integers(1, 30)).tolist(), int(rng.integers(1, 3000))) for _ in range(20)]
    kept = []
    for nbytes, cap in cases:
        _buckets_case(fn, nbytes, cap, kept)


def _buckets_case(fn, nbytes, cap, kept):
    """One call, in a frame of its own: no answer of an earlier case is left in reach."""
    got = fn(list(nbytes), cap)
    plain = _plain(got) if got is not None else None
    kept.append((nbytes, cap, got, plain))
    for was, was_cap, was_got, was_plain in kept[:-1]:
        if was_plain is not None and _plain(was_got) != was_plain:
            raise AssertionError(f"the buckets assign_buckets returned for sizes {was} with buckets of {was_cap} "
                                 f"bytes changed when it was called again (sizes {nbytes}, {cap} bytes): return "
                                 "new lists on every call, not a list kept between calls")
    expected = _buckets(nbytes, cap)                            # the answer, only now
    if plain != expected:
        raise AssertionError(f"sizes {nbytes} with buckets of {cap} bytes: got {plain if plain is not None else got}, "
                             f"expected {expected}")


# Lesson 02 at a tiny shape, one step on the graded ranks (batch 2 per rank): the data-parallel
# run against one process (loss, raw gradients, weights) is its verdict. --naive: its run
# averages with average_gradients after every backward (the bucketed run never calls it);
# its timing part calls it once more, and assign_buckets twice.
TINY = ("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--steps", "1",
        "--timing-reps", "1", "--peak-tflops", "1")


def _argv(*extra):
    return lambda n: (*TINY, "--batch-size", str(2 * n), *extra)


NAIVE = (Run("02_data_parallel", _argv("--naive")),)
# 2 KiB buckets: the tiny model's 16 parameters (64 B to 32 KiB) in 5 buckets in float64, 4 in float32
BUCKETED = (Run("02_data_parallel", _argv("--bucket-mb", "0.002")),)

EXERCISES = [
    Exercise("2.1", "average_gradients", data_parallel.average_gradients, check_average_gradients, 3,
             groups=True, runs=NAIVE),
    Exercise("2.2", "assign_buckets", data_parallel.assign_buckets, check_assign_buckets, runs=BUCKETED),
]
