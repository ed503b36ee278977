"""Checks for lessons/exercises/05_zero.py: the partition and the stage-2 reduce-scatter.

partition is checked alone against numpy.array_split, for every rank of many sizes
(lengths that do not divide, lengths shorter than the world). reduce_scatter_grad runs on
every rank under mpirun with a CountingComm (minidist/grader/counting.py), which
refuses MPI's collectives and counts the bytes this rank sends: each rank builds its own
gradient from a seed of its rank, so each can compute the expected partition of the mean
alone. The bytes are held to one ring reduce-scatter's count (all but my chunk): a full
all-reduce leaves the right partition too, but sends twice as much, and FAILS. The result
must keep the gradient's dtype, and be a new array: the first length is graded again with
other gradients, and the first result must not change (a buffer kept between calls).
"""
import numpy as np

from minidist.grader.checks import Exercise, own_session, world_then_groups
from minidist.parallel import zero
from minidist.parallel.tp_formulas import ring_all_gather_sent, ring_reduce_scatter_sent

REFUSE = "use ring_reduce_scatter(comm, flat, op=\"sum\") from minidist.comm: this exercise reduce-scatters on the ring"
LENGTHS = [23, 8, 2, 0]          # uneven, even at 4, shorter than the world, empty


def check_partition(fn):
    for n in list(range(0, 13)) + [97, 1000]:
        for size in range(1, 10):
            pieces = np.array_split(np.arange(n), size)
            lo = 0
            for rank in range(size):
                want = (lo, lo + len(pieces[rank]))
                lo = want[1]
                got = fn(n, size, rank)
                got = tuple(map(int, got)) if got is not None else None
                if got != want:
                    raise AssertionError(
                        f"partition({n}, {size}, {rank}) = {got}, expected {want}: numpy.array_split gives the first "
                        f"{n % size} rank(s) {n // size + 1} elements and the others {n // size}")


def _grad(rank, n, salt=0):
    return np.random.default_rng([500 + 31 * rank + n, salt]).standard_normal(n)


def check_reduce_scatter_grad(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _reduce_scatter_cases(fn, s))


def _reduce_scatter_cases(fn, s):
    rank, size = s.rank(), s.size()
    results = [(n, _reduce_scatter_one(fn, s, n, 0)) for n in LENGTHS]
    n, first = results[0]
    keep = first.copy()
    _reduce_scatter_one(fn, s, n, 1)                 # the same length again, other gradients
    if not np.array_equal(first, keep):
        raise AssertionError(f"rank {rank}: the partition returned for {n} values changed when reduce_scatter_grad "
                             "was called again with other gradients of the same length: return a new array on "
                             "every call (a buffer kept between calls is overwritten by the next step)")


def _reduce_scatter_one(fn, s, n, salt):
    rank, size = s.rank(), s.size()
    flat = _grad(rank, n, salt)
    before = flat.copy()
    mean = sum(_grad(r, n, salt) for r in range(size)) / size
    want = np.array_split(mean, size)[rank]
    comm = s.counting(REFUSE)
    got = fn(comm, flat)
    if comm.refused:
        raise AssertionError(comm.refused)
    if not np.array_equal(flat, before):
        raise AssertionError(f"rank {rank}: the input of length {n} was changed; return a new array")
    got = np.asarray(got)
    if got.shape != want.shape:
        raise AssertionError(f"rank {rank}: for {n} values on {size} ranks the result has shape {got.shape}; "
                             f"my partition is chunk {rank} of numpy.array_split, shape {want.shape}"
                             + (" (the whole mean: reduce-scatter, do not all-reduce)" if got.size == n else ""))
    if got.dtype != flat.dtype:
        raise AssertionError(f"rank {rank}: the result is {got.dtype}, the gradient is {flat.dtype}: keep the "
                             f"gradient's dtype (no astype; a {got.dtype} partition rounds the mean)")
    if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
        j = int(np.argmax(np.abs(got - want)))
        hint = (" (the sum: divide by N = comm.Get_size())" if np.isclose(got[j], want[j] * size) else
                " (divided twice?)" if np.isclose(got[j] * size, want[j]) else "")
        raise AssertionError(f"rank {rank}: element {j} of my partition of {n} values is {got[j]:.6f}, "
                             f"expected the mean over {size} ranks {want[j]:.6f}{hint}")
    expected = ring_reduce_scatter_sent(n, 1, size, rank) * flat.itemsize
    if comm.bytes_sent != expected:
        all_reduce = expected + ring_all_gather_sent(n, 1, size, rank) * flat.itemsize
        hint = (" (a reduce-scatter and an all-gather: that is a full all-reduce, whose second half sends "
                "partitions this rank does not keep)" if expected and comm.bytes_sent == all_reduce else "")
        raise AssertionError(f"rank {rank}: sent {comm.bytes_sent} bytes to reduce-scatter {n} values on "
                             f"{size} ranks; one ring reduce-scatter sends {expected} (all but my chunk)"
                             + hint)
    return got


EXERCISES = [
    Exercise("5.1", "partition", zero.partition, check_partition),
    Exercise("5.2", "reduce_scatter_grad", zero.reduce_scatter_grad, check_reduce_scatter_grad, 3, groups=True),
]
