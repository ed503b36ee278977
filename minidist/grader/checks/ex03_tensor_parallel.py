"""Checks for lessons/exercises/03_tensor_parallel.py, run on every rank under mpirun.

Every rank builds the problem from a fixed seed, hands the student's function only this
rank's part, as the package's layers hold it (columns of A for a column-parallel layer,
rows for a row-parallel one, a range of the vocabulary for the loss), and only then, after
the function has returned, builds the whole problem again and computes the
single-process answer with NumPy. So while the student's code runs, no frame it can
reach (sys._getframe(1).f_locals ...) holds the answer or the other ranks' parts; every
part handed over is a copy (its .base is None), not a view of the whole.

Each function is tried in float64 and in float32 (inputs of that dtype, the answer
computed in float64 from them): the result must have the input's dtype, and its values
must be within TOL[dtype] x max(|expected|, 1) of the answer (the messages say which
dtype and tolerance). Each is called several times, with other inputs of the same shape
among them: a result returned earlier must keep its values (an output buffer reused per
shape fails). Sizes do not divide by 3, 4, 5 or 8 (numpy.array_split pieces, uneven
rings), and the vocabulary is padded as the package pads it: on the last rank, and in
another case on several ranks (a vocabulary smaller than t squared), where the padded
columns hold logits far above the real ones, so that padding counted anywhere (in the
max, in the sum, on some ranks only) changes the loss.

The student's functions get a CountingComm (minidist/grader/counting.py): MPI's
collectives are refused, so the sums go through minidist.comm.all_reduce (the ring, on
point-to-point messages the communicator counts), and each call is held to the bytes of
exactly the all-reduces the layer needs (docs/reference.md#tensor-parallelism):

    f forward, g backward, column forward, row backward     nothing
    f backward, g forward, column backward, row forward     one all-reduce of the activation
    vocab-parallel loss                                     three all-reduces of N = b*s numbers

each 2(N-1)/N of the array per rank, within one element per chunk where lengths do not
divide, in the input's dtype (float64 numbers in a float32 run show). Gathering the b*s*v
logits shows at once. Each check also verifies that no input changed, and that every rank
holds the very same bits of a replicated result.
"""
import hashlib
import itertools
import math

import numpy as np

from minidist.comm.collectives import chunk_bounds
from minidist.grader.checks import Exercise, own_session
from minidist.grader.plugin import Run
from minidist.parallel import tensor_parallel as tp

MIN_RANKS = 3
REFUSE = ("use all_reduce(comm, x, op=\"sum\") from minidist.comm: the grader counts the ring's bytes "
          "(the communicator it hands you refuses MPI's collectives)")
DTYPES = (np.dtype(np.float64), np.dtype(np.float32))
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}   # x max(|expected|, 1)
B, T = 2, 7                      # b*s = 14 tokens: 3, 4, 5 and 8 do not divide it
PAD_ABOVE = 1000.0               # padded logits: this far above the row's real maximum (even rows)


# ----------------------------------------------------------------------------- helpers

def _rng(*seed):
    return np.random.default_rng([3] + list(seed))


def _normal(shape, dtype, *seed):
    return _rng(*seed).standard_normal(shape).astype(dtype)


def _part(a, axis, rank, t):
    """Rank `rank`'s chunk of `a` along `axis`: a copy, so that no view leads back to the whole."""
    b = chunk_bounds(a.shape[axis], t)
    index = [slice(None)] * a.ndim
    index[axis] = slice(b[rank], b[rank + 1])
    return np.array(a[tuple(index)], copy=True)


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _short(a):
    a = np.asarray(a)
    text = np.array2string(a.reshape(-1)[:5], precision=5, separator=", ")
    return text[:-1] + ", ...]" if a.size > 5 else text


def _num(x, digits):
    return f"{float(x):.{digits}g}"


def _close(got, other, dtype):
    other = _f64(other)
    if other.shape != got.shape:
        return False
    scale = max(float(np.max(np.abs(other[np.isfinite(other)]), initial=0.0)), 1.0)
    return bool(np.allclose(got, other, rtol=0.0, atol=TOL[dtype] * scale, equal_nan=True))


def _mismatch(got, want, what, dtype, hints=()):
    """None when got is within the dtype's tolerance of want, else a sentence.

    want: the answer in float64, computed from the inputs of `dtype`. The tolerance is
    TOL[dtype] x max(|want|, 1); a message for values that differ says the dtype, the
    difference and the tolerance. hints: (array, words): when got equals that array
    instead, say the words.
    """
    if got is None:
        return f"{what}: got None, expected an array of shape {np.shape(want)}"
    try:
        got = _f64(got)
    except (TypeError, ValueError):
        return f"{what}: got {type(got).__name__}, expected an array of shape {np.shape(want)}"
    want = _f64(want)
    if got.shape != want.shape:
        return f"{what}: got shape {got.shape}, expected {want.shape}"
    tol = TOL[dtype]
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1.0)
    if want.size == 0 or (np.all(np.isfinite(got)) and float(np.max(np.abs(got - want))) <= tol * scale):
        return None
    for other, words in hints:
        if _close(got, other, dtype):
            if got.ndim == 0:
                return f"{what}: got {_num(got, 6)}, expected {_num(want, 6)} ({words})"
            return f"{what}: got {_short(got)}, expected {_short(want)} ({words})"
    diff = np.where(np.isfinite(got), np.abs(got - want), np.inf)
    j = np.unravel_index(int(np.argmax(diff)), got.shape)
    worst = float(diff[j])
    digits = 6 if not math.isfinite(worst) or worst == 0 else min(17, max(6, math.ceil(math.log10(scale / worst)) + 2))
    limit = (f"{'not finite' if not math.isfinite(worst) else f'off by {worst:.2g}'}; the {dtype} tolerance is "
             f"{tol:g} x max(|expected|, 1) = {tol * scale:.2g}")
    if got.ndim == 0:
        return f"{what}: got {_num(got, digits)}, expected {_num(want, digits)} ({limit})"
    return (f"{what}: at {list(map(int, j))} got {_num(got[j], digits)}, expected {_num(want[j], digits)} "
            f"({limit}; got {_short(got)}, expected {_short(want)})")


def _dtype_problem(got, dtype, what, of="the result", inputs="the input"):
    """None when `got` has the input's dtype, else a sentence (float64 arrays made by
    np.zeros(n) in a float32 run are the usual cause)."""
    have = np.asarray(got).dtype
    if have == dtype:
        return None
    return (f"{what}: {of} is {have}, {inputs} is {dtype}: keep the input's dtype (np.zeros(n), np.ones(n) and "
            f"np.empty(n) are float64: pass the dtype, np.zeros(n, x.dtype), or use np.zeros_like(x))")


def _loss_dtype_problem(loss, dtype, what):
    """None when the loss is one number a caller can use in the logits' dtype: a NumPy value
    of that dtype, or a Python float (float(np.mean(...)): the package's caller converts it
    with xp.asarray(loss, dtype=logits.dtype)); else a sentence naming what was returned."""
    if type(loss) is float:
        return None
    have = np.asarray(loss).dtype
    if have == dtype:
        return None
    kind = (f"a NumPy {have} scalar ({type(loss).__module__}.{type(loss).__name__})" if np.ndim(loss) == 0
            and isinstance(loss, np.generic) else f"a {have} array of shape {np.shape(loss)}"
            if isinstance(loss, np.ndarray) else f"a {type(loss).__name__} ({have})")
    return (f"{what}: the loss is {kind}, the logits are {dtype}: return it in the logits' dtype (a NumPy "
            f"mean of {dtype} values is {dtype}; a {have} value says some of the arithmetic ran in {have}: "
            "np.zeros(n) is float64, np.zeros(n, logits.dtype) is not) or as a Python float, float(...)")


def _ring_bytes(sizes, t, itemsizes):
    """(lo, hi) bytes one rank sends for ring all-reduces of arrays of these element counts."""
    lo = hi = 0
    for n, item in zip(sizes, itemsizes):
        chunks = [b - a for a, b in zip(chunk_bounds(n, t), chunk_bounds(n, t)[1:])]
        lo += 2 * (n - max(chunks)) * item
        hi += 2 * (n - min(chunks)) * item
    return lo, hi


def _bytes_problem(comm, sizes, what, words, dtype, gathered=None):
    """None when this rank sent the bytes of ring all-reduces of `sizes` elements of
    `dtype`, else a sentence."""
    t, r = comm.Get_size(), comm.Get_rank()
    item = dtype.itemsize
    lo, hi = _ring_bytes(sizes, t, [item] * len(sizes))
    sent = comm.bytes_sent
    if lo <= sent <= hi:
        return None
    want = f"{lo} bytes" if lo == hi else f"{lo} to {hi} bytes"
    wider = [k for k in range(1, len(sizes) + 1) if item < 8 and any(
        a <= sent <= b for a, b in (_ring_bytes(sizes, t, [8 if i in c else item for i in range(len(sizes))])
                                    for c in itertools.combinations(range(len(sizes)), k)))]
    if not sizes:
        hint = f"{words}: nothing moves in this direction"
    elif sent == 0:
        hint = f"{words}: no all-reduce went through the communicator it was given"
    elif wider:
        k = wider[0]
        hint = (f"{words}; {sent} bytes is what {'it' if len(sizes) == 1 else f'{k} of them'} sends in float64: "
                f"the inputs are {dtype}: keep their dtype in what you all-reduce (np.zeros(n) is float64: "
                "np.zeros(n, x.dtype))")
    elif gathered is not None and sent >= (t - 1) * gathered // t:
        hint = (f"{words}; {sent} bytes is the size of the whole logits ({gathered} bytes) gathered: "
                "never gather them, all-reduce three numbers per token")
    else:
        hint = f"{words}: {'more' if sent > hi else 'less'} than that was sent"
    return f"rank {r} sent {sent} bytes for {what}; expected {want} of {dtype} numbers, {hint}"


def _unchanged(args, before, name, rank):
    for i, (a, b) in enumerate(zip(args, before)):
        if b is not None and not np.array_equal(a, b):
            return f"rank {rank}: {name} changed its input number {i + 1} (an in-place write); use new arrays"
    return None


def _call(s, fn, *args):
    """fn(counting comm, *args) with copies of the inputs kept: (result, comm), or raises."""
    comm = s.counting(REFUSE)
    before = [np.copy(a) if isinstance(a, np.ndarray) else None for a in args]
    out = fn(comm, *args)
    problem = comm.refused or _unchanged(args, before, fn.__name__, s.rank())
    if problem:
        raise AssertionError(problem)
    return out, comm


class _Kept:
    """Every result a function returned so far, with a copy of its values: a later call
    must leave them as they were (a caller keeps the probabilities for the backward, the
    engine keeps activations while the next micro-batch runs)."""

    def __init__(self, name, rank=None):
        self.name, self.who, self.items = name, "" if rank is None else f"rank {rank}: ", []

    def add(self, results, words):
        for a in results:
            if isinstance(a, np.ndarray):
                self.items.append((a, a.copy(), words))

    def check(self, now):
        """None when every kept result still holds its values, else a sentence."""
        for ref, copy, words in self.items:
            if ref.shape != copy.shape or not np.array_equal(ref, copy, equal_nan=ref.dtype.kind in "fc"):
                same = " of the same shape" if now[1] == words[1] else ""
                return (f"{self.who}the result {self.name} returned in {words[0]} changed when {self.name} was "
                        f"called again with other inputs{same}, in {now[0]}: it returned an array it keeps and "
                        "writes over (an output buffer reused per shape?); return a new array each call")
        return None

    def after(self, results, words):
        """The check after a call: earlier results unchanged; then keep this call's."""
        problem = self.check(words)
        self.add(results, words)
        return problem


def _digest(a):
    raw = np.ascontiguousarray(np.asarray(a, dtype=np.float64)).tobytes()
    return np.frombuffer(hashlib.blake2b(raw, digest_size=8).digest(), np.uint64).copy()


def _same_everywhere(s, a, what):
    """Every rank must hold the very same bits of a replicated result (the check's own messages)."""
    n = s.size()
    digests = s.allgather(_digest(a), np.empty((n, 1), np.uint64))
    if not (digests == digests[0]).all():
        raise AssertionError(f"{what}: ranks hold different results; a replicated result must be "
                             "identical on every rank")


def _raise(*problems):
    for p in problems:
        if p:
            raise AssertionError(p)


def _tuple(out, name, rank, names):
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise AssertionError(f"rank {rank}: {name} must return ({', '.join(names)}), got {type(out).__name__}")
    return out


# ----------------------------------------------------------------------------- f and g

# 154, 1, 154 and 13 elements: no tried world size divides them; the third call has the
# first one's shape (other values), so a result buffer kept per shape shows.
SHAPES = [(B, T, 11), (1, 1, 1), (B, T, 11), (1, 13, 1)]


def _own_part(shape, dtype, seed, k, rank):
    """This rank's partial array of call k (what it holds before a sum)."""
    return _normal(shape, dtype, seed, k, rank)


def _sum_of_parts(shape, dtype, seed, k, n):
    """Built after the call: the sum of every rank's part, in float64."""
    return sum(_f64(_own_part(shape, dtype, seed, k, j)) for j in range(n))


def _check_identity(fn, session, seed, name, of, twice):
    """f's forward and g's backward: every rank already holds the whole array; return it."""
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        kept = _Kept(name, r)
        for dtype in DTYPES:
            for k, shape in enumerate(SHAPES):
                x = _normal(shape, dtype, seed, k)              # whole, the same on every rank
                got, comm = _call(s, fn, x)
                what = f"rank {r}: {name} of {of} of shape {shape}, {dtype}"
                _raise(_mismatch(got, _f64(x), what, dtype, [(_f64(x) * n, twice)]),
                       _dtype_problem(got, dtype, what),
                       _bytes_problem(comm, [], f"{name} of {shape}", f"{name} is the identity", dtype),
                       kept.after([got], (f"call {k + 1} ({dtype}, shape {shape})", shape)))


def check_f_forward(fn, session=None):
    _check_identity(fn, session, 10, "f's forward", "x", "the sum over ranks: f's forward is the identity")


def check_g_backward(fn, session=None):
    _check_identity(fn, session, 13, "g's backward", "a gradient",
                    "the sum over ranks: g's backward is the identity, the sum happened going forward")


def _check_sum(fn, session, seed, name, of, only_mine, words):
    """f's backward and g's forward are the same computation (the sum of every rank's part,
    one all-reduce), checked in each one's own words."""
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        kept = _Kept(name, r)
        for dtype in DTYPES:
            for k, shape in enumerate(SHAPES):
                got, comm = _call(s, fn, _own_part(shape, dtype, seed, k, r))
                what = f"rank {r}: {name} of {of} of shape {shape}, {dtype}"
                _raise(_mismatch(got, _sum_of_parts(shape, dtype, seed, k, n), what, dtype,
                                 [(_own_part(shape, dtype, seed, k, r), only_mine)]),
                       _dtype_problem(got, dtype, what),
                       _bytes_problem(comm, [int(np.prod(shape))], f"{name} of {shape}", words, dtype),
                       kept.after([got], (f"call {k + 1} ({dtype}, shape {shape})", shape)))
                _same_everywhere(s, got, f"{name} of {shape}, {dtype}")


def check_f_backward(fn, session=None):
    # rank k's part of dX: (dY_k) A_k^T
    _check_sum(fn, session, 11, "f's backward", "a gradient",
               "this rank's part only: f's backward sums the parts of all ranks", "one all-reduce of the gradient")


def check_g_forward(fn, session=None):
    # rank k's partial sum X_k A_k
    _check_sum(fn, session, 12, "g's forward", "x", "this rank's partial sum only: g's forward adds the parts",
               "one all-reduce of the activation")

# ----------------------------------------------------------------------------- the split


SPLIT_CASES = [((6, 9), 1), ((6, 9), 0), ((7,), 0), ((4, 10), 1), ((3, 4, 5), 2), ((3, 4, 5), 1), ((2, 3), 1),
               ((2, 13), 1), ((11, 2), 0)]
SPLIT_WORDS = ("a column-parallel weight (in, out) is cut along axis 1, its bias along axis 0; "
               "a row-parallel weight along axis 0")


def _split_problem(a, axis, rank, t, got, what, dtype):
    """Built after the call: rank's piece, compared (exactly: a split moves values, it computes nothing)."""
    pieces = np.array_split(a, t, axis=axis)
    want = pieces[rank]
    problem = _mismatch(got, want, what, dtype, [])
    if problem is None and not np.array_equal(got, want):
        problem = f"{what}: got other values than the piece's own (a split copies values exactly)"
    if problem:
        other = [k for k in range(t) if k != rank and pieces[k].shape == np.shape(got)
                 and np.array_equal(got, pieces[k])]
        if other:
            problem += f" (that is rank {other[0]}'s piece)"
        elif np.shape(got) != want.shape:
            problem += f"; {SPLIT_WORDS}; the first len % t pieces are one longer"
    return problem


def check_split_for_rank(fn):
    """Serial: every (shape, axis, t, rank), uneven lengths included, in float64 and float32,
    against numpy.array_split (computed after each call)."""
    kept = _Kept("split_for_rank")
    for dtype in DTYPES:
        for c, (shape, axis) in enumerate(SPLIT_CASES):
            a = _normal(shape, dtype, 14, c)
            before = a.copy()
            for t in (1, 2, 3, 4, 5, 8):
                for rank in range(t):
                    got = fn(a, axis, rank, t)
                    what = (f"split_for_rank(a of shape {shape}, {dtype}, axis={axis}, rank={rank}, t={t}) "
                            f"(rank {rank}'s piece: numpy.array_split(a, t, axis)[rank])")
                    _raise(_split_problem(a, axis, rank, t, got, what, dtype),
                           _dtype_problem(got, dtype, what),
                           None if np.array_equal(a, before) else
                           f"split_for_rank(a of shape {shape}, axis={axis}, rank={rank}, t={t}) changed a")
                    kept.add([got], (f"the call for rank {rank} of {t} (a of shape {shape}, {dtype}, axis={axis})",
                                 shape))
            _raise(kept.check((f"the calls on a of shape {shape}, {dtype}, axis={axis}", shape)))

# ----------------------------------------------------------------------------- column- and row-parallel
# x has shape (b, s, in). The cut dimension (out for a column-parallel layer, in for a
# row-parallel one) is 2n+1 or n+2 on n ranks (uneven); the other is 7 or 11 (b*s*7 = 98
# and b*s*11 = 154 elements for the all-reduces: no tried world size divides them).


LINEAR = [(0, True), (1, True), (0, True), (1, False)]     # (which size, with a bias); case 2 = case 0's shapes


def _linear_whole(n, i, cut, dtype):
    """The whole problem: X (b, s, in), A (in, out), bias (out,) or None, dY (b, s, out)."""
    k = (2 * n + 1, n + 2)[LINEAR[i][0]]
    d_in, d_out = (7, k) if cut == "columns" else (k, 11)
    x, a = _normal((B, T, d_in), dtype, 20, i), _normal((d_in, d_out), dtype, 21, i)
    bias = _normal((d_out,), dtype, 22, i) if LINEAR[i][1] else None
    dy = _normal((B, T, d_out), dtype, 23, i)
    return x, a, bias, dy


def _column_inputs(n, r, i, dtype, backward):
    """What rank r's column-parallel layer holds: X whole, its columns of A, and of b or of dY."""
    x, a, bias, dy = _linear_whole(n, i, "columns", dtype)
    if backward:
        return x, _part(a, 1, r, n), _part(dy, 2, r, n)
    return x, _part(a, 1, r, n), None if bias is None else _part(bias, 0, r, n)


def _row_inputs(n, r, i, dtype, backward):
    """What rank r's row-parallel layer holds: its columns of X, its rows of A, b or dY whole."""
    x, a, bias, dy = _linear_whole(n, i, "rows", dtype)
    return _part(x, 2, r, n), _part(a, 0, r, n), (dy if backward else bias)


def _whole64(n, i, cut, dtype):
    return [None if v is None else _f64(v) for v in _linear_whole(n, i, cut, dtype)]


def _linear_words(i, dtype, x, a, third, name):
    return f"case {i + 1}, {dtype}, X {np.shape(x)}, A_r {np.shape(a)}, " + \
        (f"{name} {np.shape(third)}" if third is not None else "no bias")


def _column_forward_problems(got, n, r, i, dtype, what):
    x, a, bias, _ = _whole64(n, i, "columns", dtype)
    y_r = _part(x @ a + (0 if bias is None else bias), 2, r, n)
    return _mismatch(got, y_r, what, dtype, [(y_r * n, "the sum over ranks: the columns need no sum")])


def check_column_parallel_forward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        kept = _Kept("column_parallel_forward", r)
        for dtype in DTYPES:
            for i in range(len(LINEAR)):
                x, a_r, b_r = _column_inputs(n, r, i, dtype, False)
                what = "column-parallel forward, " + _linear_words(i, dtype, x, a_r, b_r, "b_r")
                got, comm = _call(s, fn, x, a_r, b_r)
                _raise(_column_forward_problems(got, n, r, i, dtype, f"rank {r}: {what}"),
                       _dtype_problem(got, dtype, f"rank {r}: {what}"),
                       _bytes_problem(comm, [], what, "f's forward is the identity: a column-parallel layer's "
                                                      "forward is local", dtype),
                       kept.after([got], (f"case {i + 1} ({dtype})", np.shape(got))))


def _column_backward_problems(out, n, r, i, dtype, what):
    gx, gw, gb = out
    x, a, _, dy = _whole64(n, i, "columns", dtype)
    a_r, dy_r = _part(a, 1, r, n), _part(dy, 2, r, n)
    dw_r = _part(np.einsum("bti,bto->io", x, dy), 1, r, n)
    db_r = _part(dy.sum(axis=(0, 1)), 0, r, n)
    return [_mismatch(gx, dy @ a.T, f"rank {r}: grad_x of the {what}", dtype,
                      [(dy_r @ a_r.T, "this rank's part only: dX = sum over ranks of dY_r A_r^T, "
                        "all-reduce it (f's backward)")]),
            _mismatch(gw, dw_r, f"rank {r}: grad_weight of the {what}", dtype,
                      [(n * dw_r, "summed over ranks: dA_r = X^T dY_r is local")]),
            _mismatch(gb, db_r, f"rank {r}: grad_bias of the {what}", dtype,
                      [(n * db_r, "summed over ranks: db_r is local")])]


def _grads_dtype(out, dtype, what, rank):
    for name, g in zip(("grad_x", "grad_weight", "grad_bias"), out):
        problem = _dtype_problem(g, dtype, f"rank {rank}: {name} of the {what}")
        if problem:
            return problem
    return None


def check_column_parallel_backward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        name = "column_parallel_backward"
        kept = _Kept(name, r)
        for dtype in DTYPES:
            for i in range(len(LINEAR)):
                x, a_r, dy_r = _column_inputs(n, r, i, dtype, True)
                what = "column-parallel backward, " + _linear_words(i, dtype, x, a_r, dy_r, "dY_r")
                out, comm = _call(s, fn, x, a_r, dy_r)
                out = _tuple(out, name, r, ("grad_x", "grad_weight", "grad_bias"))
                _raise(*_column_backward_problems(out, n, r, i, dtype, what),
                       _grads_dtype(out, dtype, what, r),
                       _bytes_problem(comm, [x.size], what, "one all-reduce of dX, the size of X", dtype),
                       kept.after(out, (f"case {i + 1} ({dtype})", np.shape(out[0]))))
                _same_everywhere(s, out[0], f"grad_x of the {what}")


def _row_forward_problems(got, n, r, i, dtype, what):
    x, a, bias, _ = _whole64(n, i, "rows", dtype)
    y = x @ a + (0 if bias is None else bias)
    x_r, a_r = _part(x, 2, r, n), _part(a, 0, r, n)
    hints = [(x_r @ a_r + (0 if bias is None else bias), "this rank's partial sum: all-reduce X_r A_r "
              "(g's forward)")]
    if bias is not None:
        hints.append((y + (n - 1) * bias, f"the bias counted {n} times: add it once, after the sum"))
    return _mismatch(got, y, what, dtype, hints)


def check_row_parallel_forward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        kept = _Kept("row_parallel_forward", r)
        for dtype in DTYPES:
            for i in range(len(LINEAR)):
                x_r, a_r, bias = _row_inputs(n, r, i, dtype, False)
                what = "row-parallel forward, " + _linear_words(i, dtype, x_r, a_r, bias, "bias")
                got, comm = _call(s, fn, x_r, a_r, bias)
                _raise(_row_forward_problems(got, n, r, i, dtype, f"rank {r}: {what}"),
                       _dtype_problem(got, dtype, f"rank {r}: {what}"),
                       _bytes_problem(comm, [B * T * 11], what, "one all-reduce of Y, the layer's output", dtype),
                       kept.after([got], (f"case {i + 1} ({dtype})", np.shape(got))))
                _same_everywhere(s, got, what)


def _row_backward_problems(out, n, r, i, dtype, what):
    gx, gw, gb = out
    x, a, _, dy = _whole64(n, i, "rows", dtype)
    a_r = _part(a, 0, r, n)
    return [_mismatch(gx, dy @ a_r.T, f"rank {r}: grad_x of the {what}", dtype,
                      [(n * (dy @ a_r.T), "summed over ranks: dX_r = dY A_r^T is this rank's columns, local")]),
            _mismatch(gw, _part(np.einsum("bti,bto->io", x, dy), 0, r, n), f"rank {r}: grad_weight of the {what}",
                      dtype, []),
            _mismatch(gb, dy.sum(axis=(0, 1)), f"rank {r}: grad_bias of the {what}", dtype,
                      [(n * dy.sum(axis=(0, 1)), "summed over ranks: dY is already whole, db is local")])]


def check_row_parallel_backward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        name = "row_parallel_backward"
        kept = _Kept(name, r)
        for dtype in DTYPES:
            for i in range(len(LINEAR)):
                x_r, a_r, dy = _row_inputs(n, r, i, dtype, True)
                what = "row-parallel backward, " + _linear_words(i, dtype, x_r, a_r, dy, "dY")
                out, comm = _call(s, fn, x_r, a_r, dy)
                out = _tuple(out, name, r, ("grad_x", "grad_weight", "grad_bias"))
                _raise(*_row_backward_problems(out, n, r, i, dtype, what),
                       _grads_dtype(out, dtype, what, r),
                       _bytes_problem(comm, [], what, "g's backward is the identity: a row-parallel layer's "
                                                      "backward is local", dtype),
                       kept.after(out, (f"case {i + 1} ({dtype})", np.shape(out[0]))))

# ----------------------------------------------------------------------------- the vocabulary-parallel loss


def _vocab_size(n, i):
    """Case 1: padding on several ranks (a vocabulary smaller than t squared: on 4 ranks,
    5 ids padded to 8, ranks 2 and 3 hold padding); cases 0 and 2 (the same shapes, other
    values) and 3: padding on the last rank."""
    if i == 1:
        return 2 * n - 3 if n >= 4 else 1
    return 3 * n + 1 if i == 3 else 5 * n - 2


VOCAB_CASES = range(4)


def _vocab_case(n, i, dtype):
    """The whole problem for n ranks: (logits (N, V_padded) of dtype, targets (N,), V, per rank)."""
    V = _vocab_size(n, i)
    per = tp.padded_vocab(V, n) // n
    rng = _rng(30, i, n)
    logits = rng.standard_normal((B * T, per * n)) * 3.0
    logits[0, :V] += 1000.0                              # exp(1000) overflows: shift by the max first
    top = logits[:, :V].max(axis=1)
    logits[:, V:] = (top + np.where(np.arange(B * T) % 2 == 0, PAD_ABOVE, 3.0))[:, None]
    targets = rng.integers(0, V, size=B * T)             # padded ids count as -inf: counted, they change the max
    edges = sorted({min(k * per, V - 1) for k in range(n)} | {min(k * per + per - 1, V - 1) for k in range(n)})
    targets[:min(len(edges), len(targets))] = edges[:len(targets)]   # every range's first and last id
    return logits.astype(dtype), targets, V, per


def _padding_words(V, per, n):
    pad = per * n - V
    if not pad:
        return ""
    ranks = range(V // per, n)
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f" (ids {V}-{per * n - 1} are padding, on {where})"


def _softmax_loss(logits, targets, real):
    """(loss, probs) in float64 with the columns where `real` is False counted as -inf."""
    z = np.where(real, _f64(logits), -np.inf)
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=1, keepdims=True)
    loss = float(np.mean(np.log(s[:, 0]) + m[:, 0] - z[np.arange(len(targets)), targets]))
    return loss, e / s


def _ids(per, n):
    return np.arange(per * n)


def _vocab_forward_problems(got_loss, got_probs, n, r, i, dtype, what):
    """Built after the call: the answer, and what common mistakes would have given."""
    logits, targets, V, per = _vocab_case(n, i, dtype)
    ids = _ids(per, n)
    loss, probs = _softmax_loss(logits, targets, ids < V)
    hints = [(_softmax_loss(logits, targets, ids >= 0)[0], f"the padded columns counted as real logits: ids >= "
              f"{V} are padding, -inf on every rank that holds some")]
    if ids[V:].size and V < (n - 1) * per:             # padding on ranks before the last too
        hints.append((_softmax_loss(logits, targets, ids < (n - 1) * per)[0],
                      f"padding masked on the last rank only: ids {V}-{per * n - 1} are padding, on ranks "
                      f"{V // per}-{n - 1}: mask ids >= vocab_size on every rank"))
    scalar = np.asarray(got_loss, dtype=np.float64).reshape(()) if np.size(got_loss) == 1 else got_loss
    problem = _mismatch(scalar, np.float64(loss), f"rank {r}: the loss of the {what}", dtype, hints)
    if problem and np.size(got_loss) == 1 and not np.isfinite(scalar):
        problem += (": shift by the GLOBAL max of the real logits (all-reduce MAX), and count the padded columns "
                    "(here up to 1000 above the real ones) as -inf in the max as in the sum")
    return [problem, _mismatch(got_probs, _part(probs, 1, r, n), f"rank {r}: probs of the {what}", dtype, [])]


def _vocab_inputs(n, r, i, dtype):
    logits, targets, V, per = _vocab_case(n, i, dtype)
    return _part(logits, 1, r, n), targets, r * per, V, per


def check_vocab_parallel_cross_entropy_forward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        name = "vocab_parallel_cross_entropy_forward"
        kept = _Kept(name, r)
        for dtype in DTYPES:
            for i in VOCAB_CASES:
                mine, targets, lo, V, per = _vocab_inputs(n, r, i, dtype)
                N = len(targets)
                what = (f"vocab-parallel loss, case {i + 1}, {dtype}, N = {N} tokens, vocabulary {V} padded to "
                        f"{per * n}{_padding_words(V, per, n)}, this rank's columns [{lo}, {lo + per})")
                out, comm = _call(s, fn, mine, targets, lo, V)
                got_loss, got_probs = _tuple(out, name, r, ("loss", "probs"))
                _raise(*_vocab_forward_problems(got_loss, got_probs, n, r, i, dtype, what),
                       _dtype_problem(got_probs, dtype, f"rank {r}: probs of the {what}", inputs="the logits"),
                       _bytes_problem(comm, [N] * 3, what, f"three all-reduces of N = {N} numbers "
                                      "(the max, the target's logit, the sum of exponentials)", dtype,
                                      gathered=N * per * n * dtype.itemsize),
                       _loss_dtype_problem(got_loss, dtype, f"rank {r}: the loss of the {what}"),
                       kept.after([got_probs, got_loss], (f"case {i + 1} ({dtype})", np.shape(got_probs))))
                _same_everywhere(s, np.asarray(got_loss, dtype=np.float64), f"the loss of the {what}")


GRAD = 0.7                      # the backward's incoming gradient of the loss


def _vocab_backward_problem(got, n, r, i, dtype, what):
    logits, targets, V, per = _vocab_case(n, i, dtype)
    _, probs = _softmax_loss(logits, targets, _ids(per, n) < V)
    probs = _f64(probs.astype(dtype))                      # what the ranks were given, in float64
    onehot = np.zeros_like(probs)
    onehot[np.arange(len(targets)), targets] = 1.0
    g = GRAD
    want = (probs - onehot) * g / len(targets)
    return _mismatch(got, _part(want, 1, r, n), what, dtype,
                     [(_part(probs * g / len(targets), 1, r, n), "the one-hot of the targets is missing"),
                      (_part(probs - onehot, 1, r, n), "not scaled by grad / N")])


def _vocab_backward_inputs(n, r, i, dtype):
    logits, targets, V, per = _vocab_case(n, i, dtype)
    _, probs = _softmax_loss(logits, targets, _ids(per, n) < V)
    return _part(probs.astype(dtype), 1, r, n), targets, r * per, V, per


def check_vocab_parallel_cross_entropy_backward(fn):
    """Serial (it is local): every rank of 1, 2, 3, 4, 5 and 8, every vocabulary, float64
    and float32; grad a Python float or (as the engine passes it) a 0-d array of the dtype."""
    name = "vocab_parallel_cross_entropy_backward"
    for dtype in DTYPES:
        for n in (1, 2, 3, 4, 5, 8):
            for i in VOCAB_CASES:
                kept = _Kept(name)
                for r in range(n):
                    p_r, targets, lo, V, per = _vocab_backward_inputs(n, r, i, dtype)
                    grad = GRAD if i % 2 == 0 else np.asarray(GRAD, dtype=dtype)
                    args = (p_r, targets, lo, grad)
                    before = [np.copy(a) if isinstance(a, np.ndarray) else None for a in args]
                    got = fn(*args)
                    what = (f"vocab-parallel loss backward for rank {r} of a group of {n}, case {i + 1}, {dtype}, "
                            f"columns [{lo}, {lo + per}) of a vocabulary of {V} padded to {per * n}, grad "
                            f"{GRAD if i % 2 == 0 else f'np.asarray({GRAD}, {dtype})'}")
                    _raise(_vocab_backward_problem(got, n, r, i, dtype, what),
                           _dtype_problem(got, dtype, what, inputs="probs"),
                           _unchanged(args, before, name, r),
                           kept.after([got], (f"the call for rank {r} (case {i + 1}, {dtype})", np.shape(got))))

# ----------------------------------------------------------------------------- the plug-in check
# Lesson 03 at a small shape on the graded ranks (n = 3, 4 or 5): one head per rank of
# 4 channels, the default vocabulary of 256 (padded on 3 and 5 ranks), a batch of 2
# sequences of 4 tokens, 2 AdamW steps; without sequence parallelism, which routes the
# layers around f, g and the column/row functions. In float64 and float32.

RUNS = (Run("03_tensor_parallel", lambda n: ("--n-layer", "1", "--n-head", str(n), "--n-embd", str(4 * n),
                                             "--block-size", "4", "--batch-size", "2", "--steps", "2")),)


EXERCISES = [
    Exercise("3.1", "f_forward", tp.f_forward, check_f_forward, MIN_RANKS, runs=RUNS),
    Exercise("3.2", "f_backward", tp.f_backward, check_f_backward, MIN_RANKS, runs=RUNS),
    Exercise("3.3", "g_forward", tp.g_forward, check_g_forward, MIN_RANKS, runs=RUNS),
    Exercise("3.4", "g_backward", tp.g_backward, check_g_backward, MIN_RANKS, runs=RUNS),
    Exercise("3.5", "split_for_rank", tp.split_for_rank, check_split_for_rank, runs=RUNS),
    Exercise("3.6", "column_parallel_forward", tp.column_parallel_forward, check_column_parallel_forward, MIN_RANKS,
             runs=RUNS),
    Exercise("3.7", "column_parallel_backward", tp.column_parallel_backward, check_column_parallel_backward,
             MIN_RANKS, runs=RUNS),
    Exercise("3.8", "row_parallel_forward", tp.row_parallel_forward, check_row_parallel_forward, MIN_RANKS,
             runs=RUNS),
    Exercise("3.9", "row_parallel_backward", tp.row_parallel_backward, check_row_parallel_backward, MIN_RANKS,
             runs=RUNS),
    Exercise("3.10", "vocab_parallel_cross_entropy_forward", tp.vocab_parallel_cross_entropy_forward,
             check_vocab_parallel_cross_entropy_forward, MIN_RANKS, runs=RUNS),
    Exercise("3.11", "vocab_parallel_cross_entropy_backward", tp.vocab_parallel_cross_entropy_backward,
             check_vocab_parallel_cross_entropy_backward, runs=RUNS),
]
