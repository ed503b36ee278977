"""Checks for lessons/exercises/02_data_parallel.py, run on every rank under mpirun.

average_gradients gets a CountingComm (minidist/grader/counting.py), which
refuses MPI's collectives: the mean must go through minidist's own ring_all_reduce
(which the check also sees in minidist.comm.stats). Every rank's gradients come from a
seed of that rank, so each rank computes the expected mean alone, with no messages; a
check raises on the rank that sees the problem, and the grader agrees the verdicts.
The mean is checked twice: on the whole world, and on sub-communicators of another size
(ranks 0 .. N-2 in one group, rank N-1 alone), so a divisor written into the code
(`/ 4`, right at -n 4) fails at every size: N must come from comm.Get_size().
"""
import numpy as np

from minidist.comm import stats
from minidist.grader.checks import Exercise, own_session
from minidist.parallel import data_parallel

SHAPES = [(3, 4), (5,), (2, 2, 2), (1,), (0,), (7, 3)]
REFUSE = "use ring_all_reduce(comm, g, op=\"sum\"): this exercise averages with minidist's own ring"


def _grads(rank):
    rng = np.random.default_rng(100 + rank)  # every rank has its own gradients
    return [rng.standard_normal(s) for s in SHAPES]


def _check_mean(fn, s, members, where):
    """Run fn on session s, whose ranks are the world ranks `members`, against their mean."""
    rank, n = s.rank(), s.size()
    me = members[rank]
    grads = _grads(me)
    before = [g.copy() for g in grads]
    everyone = [_grads(k) for k in members]
    expected = [sum(gs[i] for gs in everyone) / n for i in range(len(SHAPES))]
    comm = s.counting(REFUSE)
    with stats.measure() as m:
        out = fn(comm, grads)
    if comm.refused:
        raise AssertionError(comm.refused)
    if not isinstance(out, (list, tuple)) or len(out) != len(grads):
        raise AssertionError(f"rank {me}{where}: expected a list of {len(grads)} arrays, got {type(out).__name__}"
                             + (f" of length {len(out)}" if hasattr(out, "__len__") else ""))
    for i, (g, b) in enumerate(zip(grads, before)):
        if not np.array_equal(g, b):
            raise AssertionError(f"rank {me}{where}: input gradient {i} was changed (g /= N changes the "
                                 "caller's array); return new arrays")
    for i, (g, got, want) in enumerate(zip(grads, out, expected)):
        got = np.asarray(got)
        if got.shape != g.shape:
            raise AssertionError(f"rank {me}{where}: gradient {i} has shape {got.shape}, expected {g.shape}")
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            j = np.unravel_index(np.argmax(np.abs(got - want)), g.shape)
            hint = (" (the sum: did you divide by N?)" if np.isclose(got[j], want[j] * n) else
                    " (this rank's own gradient: no message went out?)" if n > 1 and np.isclose(got[j], g[j]) else
                    " (divide by comm.Get_size(), not by a number written in the code)" if where else "")
            raise AssertionError(f"rank {me}{where}: gradient {i}{list(map(int, j))} is {got[j]:.6f}, expected "
                                 f"the mean over {n} rank{'s' if n > 1 else ''} {want[j]:.6f}{hint}")
    if n > 1 and m.bytes_sent("all_reduce") == 0:
        raise AssertionError(f"rank {me}{where}: no bytes went through minidist's ring all-reduce; "
                             "use ring_all_reduce")


def check_average_gradients(fn, session=None):
    """On the whole world, then on groups of another size (ranks 0 .. N-2, and rank N-1
    alone): a divisor written into the code (/ 4) is right at one size only."""
    with own_session(session, split=True) as s:
        _check_mean(fn, s, list(range(s.size())), "")
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


def check_assign_buckets(fn):
    cases = [([100, 200, 50, 300], 250), ([10] * 7, 25), ([10] * 6, 30), ([5, 5, 5], 1),
             ([5, 5, 5], 10**6), ([], 100), ([400], 100)]
    rng = np.random.default_rng(0)
    cases += [(rng.integers(1, 1000, size=rng.integers(1, 30)).tolist(), int(rng.integers(1, 3000))) for _ in range(20)]
    for nbytes, cap in cases:
        expected = _buckets(nbytes, cap)
        got = fn(list(nbytes), cap)
        got = [list(map(int, b)) for b in got] if got is not None else None
        if got != expected:
            raise AssertionError(f"sizes {nbytes} with buckets of {cap} bytes: got {got}, expected {expected}")


EXERCISES = [
    Exercise("2.1", "average_gradients", data_parallel.average_gradients, check_average_gradients, 3,
             groups=True),
    Exercise("2.2", "assign_buckets", data_parallel.assign_buckets, check_assign_buckets),
]
