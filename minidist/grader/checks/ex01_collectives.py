"""Checks for lessons/exercises/01_collectives.py, run on every rank under mpirun.

Every rank builds every rank's input from a fixed seed, so the expected answer is one
process's NumPy computation, with no messages; it is computed only after the student's
function returned (while it runs, the check's frames hold this rank's input alone, each
call in a frame of its own). The student's function gets a
CountingComm (minidist/grader/counting.py): point-to-point only, so a call of
comm.Allreduce (or any collective) fails with "use Send/Recv/Sendrecv: this exercise
builds the collective itself"; and counted, so each call is held to the ring's bytes:

    ring reduce-scatter   sends every chunk but one          (N-1)/N M
    ring all-gather       sends every piece but one          (N-1)/N M  (+ the lengths)
    ring all-reduce       both                              2(N-1)/N M  (+ the lengths)

M the array's bytes. When the length does not divide by N the chunks differ by one row,
so the bytes may differ from the formula by at most one row per chunk. The all-gather's
pieces have lengths each rank must learn first, point-to-point too: those few integers
are allowed for, up to N int64 per rank per step (8 N (N-1) bytes), so an extra ring step
shows in the bytes only when a piece is larger than that (the large case makes sure).

Besides small and odd shapes, each check has one large case, a few hundred KiB per
chunk: above MPI's eager limit a Send waits for its matching receive, so a ring whose
ranks all Send before they Recv deadlocks here (with tiny arrays it would pass).
Every function is called many times, in float64, float32 and an integer type (the result
keeps the input's dtype), several times with inputs of one shape and dtype; after each
call, the results of all earlier calls must be unchanged (a result that is a view of a
buffer kept between calls would change under the caller's feet).

A check raises on the rank that sees the problem; the grader agrees the verdicts of all
ranks and stops the ones left waiting (minidist/grader/command.py).
"""
import hashlib

import numpy as np
from mpi4py import MPI

from minidist.comm import collectives
from minidist.grader.checks import Exercise, own_session, world_then_groups
from minidist.grader.counting import Misuse
from minidist.grader.plugin import Run

TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
REFUSE = "use Send/Recv/Sendrecv: this exercise builds the collective itself"
BIG = 40_000          # elements per chunk in the large case: 320 KB of float64, above the eager limit
MIN_RANKS = 3         # at 2 ranks the left and right neighbours are the same rank


def _inputs(size, shape, dtype, seed):
    rng = np.random.default_rng([seed, size] + list(shape))
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-9, 10, size=shape).astype(dtype) for _ in range(size)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]


def _mine(n, r, shape, dtype, seed):
    """Rank r's input of _inputs(n, ...), made alone: while the student's function runs, the
    check's frames hold this rank's input, not the others' (from which the answer follows)."""
    return _inputs(n, shape, dtype, seed)[r]


class Kept:
    """The results of earlier calls, with copies: a later call must leave them unchanged
    (a result that is a view of a buffer kept between calls is rewritten by the next call).

    Looked at after every call, reported when the last call of the pass is over: a rank
    whose chunk of some shape is empty sees the change at a later call than the others,
    and a rank that stopped early would leave the others waiting in the ring."""

    def __init__(self, name, rank):
        self.name, self.rank, self.kept, self.found = name, rank, [], None

    def add(self, what, got):
        if isinstance(got, np.ndarray):
            self.kept.append((what, got, got.copy()))

    def look(self, now):
        for what, got, copy in self.kept[:-1]:
            if self.found is None and (got.shape != copy.shape or not np.array_equal(
                    got, copy, equal_nan=got.dtype.kind == "f")):
                self.found = (f"rank {self.rank}: the result {self.name} returned for {what} changed when it was "
                              f"called again ({now}): return a new array on every call, not a view of a buffer "
                              "kept between calls")

    def report(self):
        if self.found:
            raise AssertionError(self.found)


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
    if got.dtype != want.dtype:
        return (f"{what}: got dtype {got.dtype.name}, expected {want.dtype.name}: return the input's dtype "
                "(a wider one also sends more bytes than the ring needs)")
    if want.size == 0:
        return None
    if np.issubdtype(want.dtype, np.integer):
        ok = np.array_equal(got, want)
    else:
        scale = max(float(np.max(np.abs(want))), 1.0)
        ok = float(np.max(np.abs(got.astype(np.float64) - want))) <= TOL[want.dtype] * scale
    return None if ok else f"{what}: got {_short(got)}, expected {_short(want)}"


def _digest(a):
    """8 bytes that differ when two arrays' bits differ."""
    raw = np.ascontiguousarray(a).tobytes()
    return np.frombuffer(hashlib.blake2b(raw, digest_size=8).digest(), np.uint64).copy()


def _call(session, fn, *args, **kwargs):
    """fn(counting comm, *args): (result, the comm with its counts); MPI's errors in words."""
    comm = session.counting(REFUSE)
    try:
        out = fn(comm, *args, **kwargs)
    except MPI.Exception as e:
        # a receive posted with Irecv and completed by Wait/Waitall: the probe of the counting
        # comm cannot see the length first, so MPI reports it (in Waitall: "in the status")
        said = {MPI.ERR_TRUNCATE: "Message truncated",
                MPI.ERR_IN_STATUS: "an error in a receive's status, from Waitall"}.get(e.Get_error_class())
        if said is None:
            raise
        raise Misuse(f"at step {comm.receives - 1} or before, rank {comm.Get_rank()} received a "
                             f"message longer than its receive buffer (MPI: {said}): the ranks disagree "
                             "on a chunk's length: check which chunk you send") from None
    problem = comm.refused or comm.truncated
    if problem:
        raise Misuse(problem)
    return out, comm


def _bytes_problem(comm, chunks, phases, what, lengths_allowed=0):
    """None when this rank sent what `phases` ring phases send, else a sentence.

    chunks: the bytes of the N chunks; a phase sends all of them but one.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    total = sum(chunks)
    lo = phases * (total - max(chunks))
    hi = phases * (total - min(chunks)) + lengths_allowed
    sent = comm.bytes_sent
    if lo <= sent <= hi:
        return None
    share = f"{phases * (n - 1)}/{n}" if phases > 1 else f"{n - 1}/{n}"
    want = f"{lo} bytes" if lo == hi else f"{lo} to {hi} bytes"
    hint = ("nothing went through the communicator it was given" if sent == 0 else
            "one ring step too many? each phase has N-1 steps, one chunk each" if sent > hi else
            "a step missing?")
    return (f"rank {r} sent {sent} bytes in {comm.messages_sent} messages for {what}; the ring sends "
            f"{share} of the array's {total} bytes, {want} ({hint})")


def _unchanged(x, before, name, rank):
    return None if np.array_equal(x, before) else f"rank {rank}: {name} changed its input; return a new array"


CASES = [((7,), 0), ((1,), 0), ((0,), 0), ((12,), 0), ((5, 3), 0), ((3, 5), 1), ((2, 3, 7), 2), ((4, 2), -1)]


def _row_bytes(shape, axis, dtype):
    others = [d for i, d in enumerate(shape) if i != axis % len(shape)]
    return int(np.prod(others, dtype=np.int64)) * np.dtype(dtype).itemsize


def check_ring_reduce_scatter(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _reduce_scatter_cases(fn, s))


def _reduce_scatter_cases(fn, s):
    n, r = s.size(), s.rank()
    cases = [(dtype, shape, axis, op, 1) for dtype in (np.float64, np.float32, np.int64)
             for shape, axis in CASES
             for op in (("sum", "avg", "max") if dtype != np.int64 else ("sum", "max"))]
    cases.append((np.float64, (7,), 0, "sum", 11))           # an earlier call's shape, other values
    cases.append((np.float64, (BIG * n + 1,), 0, "sum", 1))  # large: a Send waits for its Recv
    cases.append((np.float32, (BIG * n + 1,), 0, "max", 1))  # large float32: its bytes, not float64's
    kept = Kept("ring_reduce_scatter", r)
    for case in cases:
        _reduce_scatter_case(fn, s, kept, *case)
    kept.report()


def _reduce_scatter_case(fn, s, kept, dtype, shape, axis, op, seed):
    """One call, in a frame of its own: no answer of an earlier case is left in reach."""
    n, r = s.size(), s.rank()
    x = _mine(n, r, shape, dtype, seed)
    before = x.copy()
    got, comm = _call(s, fn, x, op=op, axis=axis)
    what = f"x of shape {shape}, {np.dtype(dtype).name}, axis {axis}, op {op!r}"
    kept.add(what, got)
    xs = _inputs(n, shape, dtype, seed)                   # the answer, only now
    want = np.array_split(_reduce(xs, op).astype(dtype), n, axis=axis)[r]
    chunks = [len(c) * _row_bytes(shape, axis, dtype)
              for c in np.array_split(np.arange(shape[axis]), n)]
    problem = (_problem(got, want, f"rank {r} got for chunk {r} ({what})")
               or _unchanged(x, before, "ring_reduce_scatter", r)
               or _bytes_problem(comm, chunks, 1, what))
    if problem:
        raise AssertionError(problem)
    kept.look(what)


def check_ring_all_gather(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _all_gather_cases(fn, s))


def _piece(n, r, shape, axis, dtype, seed):
    """Rank r's piece of a whole array cut into n uneven pieces along axis (every rank's, with r=None)."""
    whole = _inputs(1, tuple(d * n + 1 for d in shape), dtype, seed)[0]
    index = tuple(slice(None) if i == axis % len(shape) else slice(0, d) for i, d in enumerate(shape))
    pieces = [p[index].copy() for p in np.array_split(whole, n, axis=axis)]   # uneven lengths
    return pieces if r is None else pieces[r]


def _all_gather_cases(fn, s):
    n, r = s.size(), s.rank()
    cases = [(dtype, shape, axis, 2) for dtype in (np.float64, np.int32) for shape, axis in CASES]
    cases.append((np.float64, (7,), 0, 12))                   # an earlier call's shape, other values
    cases.append((np.float64, (BIG,), 0, 2))                  # large pieces: above the eager limit
    cases.append((np.float32, (BIG,), 0, 2))
    kept = Kept("ring_all_gather", r)
    for case in cases:
        _all_gather_case(fn, s, kept, *case)
    kept.report()


def _all_gather_case(fn, s, kept, dtype, shape, axis, seed):
    n, r = s.size(), s.rank()
    x = _piece(n, r, shape, axis, dtype, seed)
    before = x.copy()
    got, comm = _call(s, fn, x, axis=axis)
    pieces = _piece(n, None, shape, axis, dtype, seed)    # the answer, only now
    want = np.concatenate(pieces, axis=axis)
    lengths = [p.shape[axis] for p in pieces]
    what = f"piece lengths {lengths} along axis {axis}, {np.dtype(dtype).name}"
    kept.add(what, got)
    chunks = [p.nbytes for p in pieces]
    problem = (_problem(got, want, f"rank {r} got for the joined pieces ({what})")
               or _unchanged(x, before, "ring_all_gather", r)
               or _bytes_problem(comm, chunks, 1, what, lengths_allowed=8 * n * (n - 1)))
    if problem:
        raise AssertionError(problem)
    kept.look(what)


def check_ring_all_reduce(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _all_reduce_cases(fn, s))


def _all_reduce_cases(fn, s):
    n, r = s.size(), s.rank()
    shapes = [(0,), (1,), (n - 1 or 1,), (3 * n + 2,), (2, 5), (3, 1, 4), ()]
    cases = [(dtype, shape, op, 3) for dtype in (np.float64, np.float32, np.int64) for shape in shapes
             for op in (("sum", "avg", "max") if dtype != np.int64 else ("sum", "max"))]
    cases.append((np.float64, (2, 5), "sum", 13))             # an earlier call's shape, other values
    cases.append((np.float64, (BIG * n + 2,), "sum", 3))
    cases.append((np.float32, (BIG * n + 2,), "avg", 3))
    kept = Kept("ring_all_reduce", r)
    for case in cases:
        _all_reduce_case(fn, s, kept, *case)
    kept.report()


def _all_reduce_case(fn, s, kept, dtype, shape, op, seed):
    n, r = s.size(), s.rank()
    x = _mine(n, r, shape, dtype, seed)
    before = x.copy()
    got, comm = _call(s, fn, x, op=op)
    what = f"x of shape {shape}, {np.dtype(dtype).name}, op {op!r}"
    kept.add(what, got)
    want = _reduce(_inputs(n, shape, dtype, seed), op).astype(dtype)     # the answer, only now
    size = int(np.prod(shape, dtype=np.int64))
    chunks = [len(c) * np.dtype(dtype).itemsize for c in np.array_split(np.arange(size), n)]
    problem = (_problem(got, want, f"rank {r} got for {what}")
               or _unchanged(x, before, "ring_all_reduce", r)
               or _bytes_problem(comm, chunks, 2, what, lengths_allowed=8 * n * (n - 1)))
    if problem:
        raise AssertionError(problem)
    kept.look(what)
    # every rank must hold the very same bits (data parallelism relies on it)
    digests = s.allgather(_digest(np.asarray(got, dtype)), np.empty((n, 1), np.uint64))
    if not (digests == digests[0]).all():
        raise AssertionError(f"{what}: ranks hold different results; all must be identical")


def _values_match(report):
    """Lesson 01's values verdict: every collective against one process, within the lesson's
    tolerance. Its bytes verdict counts what the package's collectives report to
    minidist.comm.stats, which a student's do not; the unit check holds them to the ring's bytes."""
    return report["max_rel_diff"] <= report["tolerance"]


# Lesson 01 at a small size on the graded ranks: its correctness table (each collective on an
# odd length, 1000 N + 3, against one process) is the verdict; its timing and alpha-beta parts
# call the functions again (ring_all_reduce with check=False, which the plug-in leaves out).
LESSON01 = Run("01_collectives", ("--size-mib", "0.01", "--repeats", "1", "--no-draw"), judge=_values_match)
# Lesson 02's --naive run averages every gradient with ring_all_reduce (through comm.all_reduce).
LESSON02 = Run("02_data_parallel", lambda n: ("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
                                              "--steps", "1", "--timing-reps", "1", "--peak-tflops", "1",
                                              "--batch-size", str(2 * n), "--naive"))

EXERCISES = [
    Exercise("1.1", "ring_reduce_scatter", collectives.ring_reduce_scatter, check_ring_reduce_scatter, MIN_RANKS,
             groups=True, runs=(LESSON01,)),
    Exercise("1.2", "ring_all_gather", collectives.ring_all_gather, check_ring_all_gather, MIN_RANKS, groups=True,
             runs=(LESSON01,)),
    Exercise("1.3", "ring_all_reduce", collectives.ring_all_reduce, check_ring_all_reduce, MIN_RANKS, groups=True,
             runs=(LESSON01, LESSON02)),
]
