"""Checks for lessons/exercises/02_data_parallel.py, run on every rank under mpirun."""
import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.lessons.checks import Exercise
from minidist.parallel import data_parallel

SHAPES = [(3, 4), (5,), (2, 2, 2), (1,), (0,), (7, 3)]


def check_average_gradients(fn):
    comm = MPI.COMM_WORLD.Dup()  # a communicator of its own: nothing left over from other checks
    rank, n = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(100 + rank)  # every rank has its own gradients
    grads = [rng.standard_normal(s) for s in SHAPES]
    before = [g.copy() for g in grads]
    expected = []
    for g in grads:  # the referee: MPI's own all-reduce, done before the student's code runs
        total = np.empty_like(g)
        comm.Allreduce(g, total, op=MPI.SUM)
        expected.append(total / n)
    with stats.measure() as m:
        out = fn(comm, grads)
    # from here on no more messages: a wrong answer on one rank raises on that rank only
    if not isinstance(out, (list, tuple)) or len(out) != len(grads):
        raise AssertionError(f"expected a list of {len(grads)} arrays, got {type(out).__name__}"
                             + (f" of length {len(out)}" if hasattr(out, "__len__") else ""))
    for i, (g, b) in enumerate(zip(grads, before)):
        if not np.array_equal(g, b):
            raise AssertionError(f"rank {rank}: input gradient {i} was changed; return new arrays")
    for i, (g, got, want) in enumerate(zip(grads, out, expected)):
        got = np.asarray(got)
        if got.shape != g.shape:
            raise AssertionError(f"rank {rank}: gradient {i} has shape {got.shape}, expected {g.shape}")
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            j = np.unravel_index(np.argmax(np.abs(got - want)), g.shape)
            raise AssertionError(f"rank {rank}: gradient {i}{list(map(int, j))} is {got[j]:.6f}, expected the "
                                 f"mean over {n} ranks {want[j]:.6f}"
                                 + (" (the sum: did you divide by N?)" if np.isclose(got[j], want[j] * n) else ""))
    if n > 1 and m.bytes_sent("all_reduce") == 0:
        raise AssertionError("no bytes went through minidist's ring all-reduce; use ring_all_reduce")
    comm.Free()


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
    Exercise("2.1", "average_gradients", data_parallel.average_gradients, check_average_gradients),
    Exercise("2.2", "assign_buckets", data_parallel.assign_buckets, check_assign_buckets),
]
