"""Checks for lessons/exercises/01_collectives.py, run on every rank under mpirun.

Every rank builds every rank's input from a fixed seed, so the expected answer is one
process's NumPy computation, with no messages. Each check runs on its own duplicate of
COMM_WORLD: messages a broken ring left behind in one check can never be received by
the next. After each call the ranks agree (MPI's own Allgather) on whether all were
right, so a wrong answer on one rank fails the check on every rank at once, with the
first failing rank's message, instead of leaving the others waiting.
"""
import numpy as np
from mpi4py import MPI

from minidist.comm import collectives
from minidist.lessons.checks import Exercise

MSG_BYTES = 400
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def _inputs(size, shape, dtype, seed):
    rng = np.random.default_rng([seed, size] + list(shape))
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-9, 10, size=shape).astype(dtype) for _ in range(size)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]


def _reduce(xs, op):
    stack = np.stack(xs)
    if op == "max":
        return stack.max(axis=0)
    total = stack.sum(axis=0)
    return total / len(xs) if op == "avg" else total


def _short(a):
    a = np.asarray(a)
    text = np.array2string(a.reshape(-1)[:6], precision=4, separator=", ")
    return text[:-1] + ", ...]" if a.size > 6 else text


def _problem(got, want, what):
    """None when got matches want, else a sentence saying how it does not."""
    if got is None:
        return f"{what}: got None, expected an array of shape {want.shape}"
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"{what}: got shape {got.shape}, expected {want.shape}"
    if want.size == 0:
        return None
    if np.issubdtype(want.dtype, np.integer):
        ok = np.array_equal(got, want)
    else:
        scale = max(float(np.max(np.abs(want))), 1.0)
        ok = float(np.max(np.abs(got.astype(np.float64) - want))) <= TOL[want.dtype] * scale
    return None if ok else f"{what}: got {_short(got)}, expected {_short(want)}"


def _all_agree(comm, problem):
    """Every rank raises AssertionError with the first failing rank's sentence, or none does."""
    flags = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([problem is not None], np.int64), flags)
    if not flags.any():
        return
    first = int(np.argmax(flags))
    buf = np.zeros(MSG_BYTES, np.uint8)
    if comm.Get_rank() == first:
        raw = problem.encode("utf-8", "replace")[:MSG_BYTES]
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    comm.Bcast(buf, root=first)
    raise AssertionError(bytes(buf).rstrip(b"\0").decode("utf-8", "replace"))


def _run(check):
    """Run check(comm) on a fresh duplicate of COMM_WORLD, freed afterwards."""
    comm = MPI.COMM_WORLD.Dup()
    try:
        check(comm)
    finally:
        comm.Free()


def _unchanged(x, before, name, rank):
    return None if np.array_equal(x, before) else f"rank {rank}: {name} changed its input; return a new array"


CASES = [((7,), 0), ((1,), 0), ((0,), 0), ((12,), 0), ((5, 3), 0), ((3, 5), 1), ((2, 3, 7), 2), ((4, 2), -1)]


def check_ring_reduce_scatter(fn):
    def check(comm):
        n, r = comm.Get_size(), comm.Get_rank()
        for dtype in (np.float64, np.float32, np.int64):
            for shape, axis in CASES:
                ops = ("sum", "avg", "max") if np.issubdtype(dtype, np.floating) else ("sum", "max")
                for op in ops:
                    xs = _inputs(n, shape, dtype, seed=1)
                    before = xs[r].copy()
                    want = np.array_split(_reduce(xs, op).astype(dtype), n, axis=axis)[r]
                    got = fn(comm, xs[r], op=op, axis=axis)
                    what = (f"rank {r} got for chunk {r} (x of shape {shape}, {np.dtype(dtype).name}, "
                            f"axis {axis}, op {op!r})")
                    _all_agree(comm, _problem(got, want, what) or
                               _unchanged(xs[r], before, "ring_reduce_scatter", r))
    _run(check)


def check_ring_all_gather(fn):
    def check(comm):
        n, r = comm.Get_size(), comm.Get_rank()
        for dtype in (np.float64, np.int32):
            for shape, axis in CASES:
                whole = _inputs(1, tuple(s * n + 1 for s in shape), dtype, seed=2)[0]
                index = tuple(slice(None) if i == axis % len(shape) else slice(0, s)
                              for i, s in enumerate(shape))
                pieces = [p[index].copy() for p in np.array_split(whole, n, axis=axis)]   # uneven lengths
                before = pieces[r].copy()
                want = np.concatenate(pieces, axis=axis)
                got = fn(comm, pieces[r], axis=axis)
                what = (f"rank {r} got for the joined pieces (piece lengths "
                        f"{[p.shape[axis] for p in pieces]} along axis {axis}, {np.dtype(dtype).name})")
                _all_agree(comm, _problem(got, want, what) or _unchanged(pieces[r], before, "ring_all_gather", r))
    _run(check)


def check_ring_all_reduce(fn):
    def check(comm):
        n, r = comm.Get_size(), comm.Get_rank()
        for dtype in (np.float64, np.float32, np.int64):
            for shape in [(0,), (1,), (n - 1 or 1,), (3 * n + 2,), (2, 5), (3, 1, 4), ()]:
                ops = ("sum", "avg", "max") if np.issubdtype(dtype, np.floating) else ("sum", "max")
                for op in ops:
                    xs = _inputs(n, shape, dtype, seed=3)
                    before = xs[r].copy()
                    want = _reduce(xs, op).astype(dtype)
                    got = fn(comm, xs[r], op=op)
                    what = f"rank {r} got for x of shape {shape}, {np.dtype(dtype).name}, op {op!r}"
                    _all_agree(comm, _problem(got, want, what) or _unchanged(xs[r], before, "ring_all_reduce", r))
                    if want.size:  # all ranks passed: now every rank must hold the very same bits
                        mine = np.ascontiguousarray(got, dtype=want.dtype)   # (data parallelism relies on it)
                        everyone = np.empty((n,) + mine.shape, mine.dtype)
                        comm.Allgather(mine, everyone)
                        same = all(np.array_equal(e, mine) for e in everyone)
                        _all_agree(comm, None if same else f"{what}: ranks hold different results; all must be identical")
    _run(check)


EXERCISES = [
    Exercise("1.1", "ring_reduce_scatter", collectives.ring_reduce_scatter, check_ring_reduce_scatter),
    Exercise("1.2", "ring_all_gather", collectives.ring_all_gather, check_ring_all_gather),
    Exercise("1.3", "ring_all_reduce", collectives.ring_all_reduce, check_ring_all_reduce),
]
