"""Checks for lessons/exercises/05_zero.py: the partition and the stage-2 reduce-scatter.

partition is checked alone against numpy.array_split, for every rank of many sizes
(lengths that do not divide, lengths shorter than the world); its bounds must be Python
ints: a float is no index, and a numpy integer (np.int64 from np.cumsum or array_split) is
not an int either (fixed width, not JSON): return int(...). reduce_scatter_grad runs on
every rank under mpirun with a CountingComm (minidist/grader/counting.py), which
refuses MPI's collectives and counts the bytes this rank sends: each rank builds its own
gradient from a seed of its rank, so each can compute the expected partition of the mean
alone, after the student's function has returned. The lengths (23, 11, 2, 0) are divided
by none of the graded world sizes 3, 4, 5, 8 nor their groups' 2, 3, 4, 7 (and 2 is
shorter than the world). The bytes are held to one ring reduce-scatter's count (all but
my chunk): a full all-reduce leaves the right partition too, but sends twice as much, and
FAILS. Every length is tried in float64, then the first again with other gradients, then
the same in float32; the result must keep the gradient's dtype, and every result returned
before must be unchanged (a buffer kept between calls is overwritten).

The plug-in check then runs lesson 05's stage 1 (partition cuts the whole model, which
reduce_scatter_grad reduces once per step) and stage 3 (partition cuts every unit, each
reduced after its backward) with the student's function, at a model of 8,806 parameters
(divided by none of 3, 4, 5, 8).
"""
import numpy as np

from minidist.grader.checks import Exercise, own_session, world_then_groups
from minidist.grader.plugin import Run
from minidist.parallel import zero
from minidist.plan.collectives import ring_all_gather_sent, ring_reduce_scatter_sent

REFUSE = "use ring_reduce_scatter(comm, flat, op=\"sum\") from minidist.comm: this exercise reduce-scatters on the ring"
LENGTHS = [23, 11, 2, 0]         # divided by none of 2, 3, 4, 5, 7, 8; shorter than the world; empty


def check_partition(fn):
    for n in list(range(0, 13)) + [97, 1000]:
        for size in range(1, 10):
            _partition_case(n, size, [fn(n, size, rank) for rank in range(size)])


def _partition_case(n, size, results):
    """Every rank's bounds for n values on size ranks, checked after the calls returned."""
    lo = 0
    for rank, (got, piece) in enumerate(zip(results, np.array_split(np.arange(n), size))):
        want = (lo, lo + len(piece))
        lo = want[1]
        call = f"partition({n}, {size}, {rank})"
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise AssertionError(f"{call} returned {got!r}; return the pair (lo, hi)")
        bad = [v for v in got if type(v) is not int]
        if bad:
            kind = type(bad[0])
            why = ("a numpy integer is not an int: wrap it in int(...)"
                   if isinstance(bad[0], np.integer) else "a float is no index: use // and int(...)")
            raise AssertionError(f"{call} returned {tuple(got)!r}: bounds are Python ints, not "
                                 f"{'' if kind.__module__ == 'builtins' else kind.__module__ + '.'}{kind.__name__} "
                                 f"({why})")
        if tuple(got) != want:
            raise AssertionError(
                f"{call} = {tuple(got)}, expected {want}: numpy.array_split gives the first "
                f"{n % size} rank(s) {n // size + 1} elements and the others {n // size}")


def _grad(rank, n, dtype, salt=0):
    return np.random.default_rng([500 + 31 * rank + n, salt]).standard_normal(n).astype(dtype)


def check_reduce_scatter_grad(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _reduce_scatter_cases(fn, s))


def _reduce_scatter_cases(fn, s):
    rank = s.rank()
    kept = []                      # (what, the array returned, a copy of it then)
    calls = [(n, np.float64, 0) for n in LENGTHS] + [(LENGTHS[0], np.float64, 1)]    # again, other gradients
    calls += [(n, np.float32, 2) for n in LENGTHS] + [(LENGTHS[0], np.float32, 3)]
    for n, dtype, salt in calls:
        got = _reduce_scatter_one(fn, s, n, dtype, salt)
        for what, old, copy in kept:
            if not np.array_equal(old, copy):
                raise AssertionError(f"rank {rank}: the partition returned for {what} changed when "
                                     "reduce_scatter_grad was called again with other gradients "
                                     f"({n} {np.dtype(dtype).name} values): return a new array on every call "
                                     "(a buffer kept between calls is overwritten by the next step)")
        kept.append((f"{n} {np.dtype(dtype).name} values", got, got.copy()))


def _reduce_scatter_one(fn, s, n, dtype, salt):
    rank, size = s.rank(), s.size()
    flat = _grad(rank, n, dtype, salt)
    before = flat.copy()
    comm = s.counting(REFUSE)
    got = fn(comm, flat)
    if comm.refused:
        raise AssertionError(comm.refused)
    if not np.array_equal(flat, before):
        raise AssertionError(f"rank {rank}: the input of length {n} was changed; return a new array")
    # the expected partition, computed only now that the student's function has returned
    mean = sum(_grad(r, n, dtype, salt).astype(np.float64) for r in range(size)) / size
    want = np.array_split(mean, size)[rank]
    got = np.asarray(got)
    if got.shape != want.shape:
        raise AssertionError(f"rank {rank}: for {n} values on {size} ranks the result has shape {got.shape}; "
                             f"my partition is chunk {rank} of numpy.array_split, shape {want.shape}"
                             + (" (the whole mean: reduce-scatter, do not all-reduce)" if got.size == n else ""))
    if got.dtype != flat.dtype:
        raise AssertionError(f"rank {rank}: the result is {got.dtype}, the gradient is {flat.dtype}: keep the "
                             f"gradient's dtype (no astype, no buffer of another dtype: a {got.dtype} partition "
                             + ("rounds the mean)" if got.itemsize < flat.itemsize else "doubles what ZeRO keeps)"))
    tol = 1e-12 if flat.dtype == np.float64 else 1e-5
    if not np.allclose(got, want, rtol=tol, atol=tol):
        j = int(np.argmax(np.abs(got - want)))
        hint = (" (the sum: divide by N = comm.Get_size())" if np.isclose(got[j], want[j] * size) else
                " (divided twice?)" if np.isclose(got[j] * size, want[j]) else "")
        raise AssertionError(f"rank {rank}: element {j} of my partition of {n} {flat.dtype} values is {got[j]:.6f}, "
                             f"expected the mean over {size} ranks {want[j]:.6f}{hint}")
    expected = ring_reduce_scatter_sent(n, 1, size, rank) * flat.itemsize
    if comm.bytes_sent != expected:
        all_reduce = expected + ring_all_gather_sent(n, 1, size, rank) * flat.itemsize
        hint = (" (a reduce-scatter and an all-gather: that is a full all-reduce, whose second half sends "
                "partitions this rank does not keep)" if expected and comm.bytes_sent == all_reduce else "")
        raise AssertionError(f"rank {rank}: sent {comm.bytes_sent} bytes to reduce-scatter {n} {flat.dtype} values "
                             f"on {size} ranks; one ring reduce-scatter sends {expected} (all but my chunk)"
                             + hint)
    return got


def lesson_05(stage):
    """A Run of lesson 05's `stage` on n ranks, at a model of 8,806 parameters (no graded size divides it)."""
    return Run("05_zero", lambda n: ("--stage", stage, "--n-layer", "2", "--n-head", "2", "--n-embd", "14",
                                      "--block-size", "9", "--batch-size", str(2 * n), "--steps", "1"))


# stage 1: partition cuts the whole model, reduce_scatter_grad reduces it once per step; stage 3:
# partition cuts each unit (a block, and the rest), reduce_scatter_grad reduces each after its backward
RUNS = (lesson_05("1"), lesson_05("3"))

EXERCISES = [
    Exercise("5.1", "partition", zero.partition, check_partition, runs=RUNS),
    Exercise("5.2", "reduce_scatter_grad", zero.reduce_scatter_grad, check_reduce_scatter_grad, 3, groups=True,
             runs=RUNS),
]
