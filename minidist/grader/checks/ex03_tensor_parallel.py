"""Checks for lessons/exercises/03_tensor_parallel.py, run on every rank under mpirun.

Every rank builds the whole problem from a fixed seed, in float64 (X, A, b, dY, the
logits of the whole vocabulary), computes the single-process answer with NumPy, and hands
the student's function only this rank's part, as the package's layers hold it: columns
of A for a column-parallel layer, rows for a row-parallel one, a range of the vocabulary
for the loss. Column and row counts are chosen so that they do not divide by the number
of ranks (numpy.array_split pieces), the vocabulary is padded as the package pads it, and
the all-reduced arrays have lengths that do not divide either.

The student's functions get a CountingComm (minidist/grader/counting.py): MPI's
collectives are refused, so the sums go through minidist.comm.all_reduce (the ring, on
point-to-point messages the communicator counts), and each call is held to the bytes of
exactly the all-reduces the layer needs (docs/reference.md#tensor-parallelism):

    f forward, g backward, column forward, row backward     nothing
    f backward, g forward, column backward, row forward     one all-reduce of the activation
    vocab-parallel loss                                     three all-reduces of N = b*s numbers

each 2(N-1)/N of the array per rank, within one element per chunk where lengths do not
divide. Gathering the b*s*v logits shows at once. Each check also verifies that no input
changed, and that every rank holds the very same bits of a replicated result.
"""
import hashlib

import numpy as np

from minidist.comm.collectives import chunk_bounds
from minidist.grader.checks import Exercise, own_session
from minidist.parallel import tensor_parallel as tp

MIN_RANKS = 3
REFUSE = ("use all_reduce(comm, x, op=\"sum\") from minidist.comm: the grader counts the ring's bytes "
          "(the communicator it hands you refuses MPI's collectives)")
TOL = 1e-10
B, T = 2, 5                      # b*s = 10 tokens: does not divide by 3, 4 or 8


# ----------------------------------------------------------------------------- helpers

def _rng(*seed):
    return np.random.default_rng([3] + list(seed))


def _normal(shape, *seed):
    return _rng(*seed).standard_normal(shape)


def _part(a, axis, rank, t):
    b = chunk_bounds(a.shape[axis], t)
    index = [slice(None)] * a.ndim
    index[axis] = slice(b[rank], b[rank + 1])
    return np.ascontiguousarray(a[tuple(index)])


def _short(a):
    a = np.asarray(a)
    text = np.array2string(a.reshape(-1)[:5], precision=5, separator=", ")
    return text[:-1] + ", ...]" if a.size > 5 else text


def _mismatch(got, want, what, hints=()):
    """None when got equals want (float64, relative to want's scale), else a sentence.

    hints: (array, words): when got equals that array instead, say the words.
    """
    if got is None:
        return f"{what}: got None, expected an array of shape {np.shape(want)}"
    try:
        got = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return f"{what}: got {type(got).__name__}, expected an array of shape {np.shape(want)}"
    if got.shape != np.shape(want):
        return f"{what}: got shape {got.shape}, expected {np.shape(want)}"
    scale = max(float(np.max(np.abs(want))) if np.size(want) else 0.0, 1.0)
    if np.size(want) == 0 or (np.all(np.isfinite(got)) and float(np.max(np.abs(got - want))) <= TOL * scale):
        return None
    for other, words in hints:
        if np.shape(other) == got.shape and np.allclose(got, other, rtol=1e-9, atol=1e-12):
            return f"{what}: got {_short(got)}, expected {_short(want)} ({words})"
    if got.ndim == 0:
        return f"{what}: got {float(got):.6g}, expected {float(want):.6g}"
    diff = np.where(np.isfinite(got), np.abs(got - want), np.inf)
    j = np.unravel_index(int(np.argmax(diff)), got.shape)
    return (f"{what}: at {list(map(int, j))} got {got[j]:.6g}, expected {want[j]:.6g} "
            f"(got {_short(got)}, expected {_short(want)})")


def _ring_bytes(sizes, t, itemsize=8):
    """(lo, hi) bytes one rank sends for ring all-reduces of arrays of these element counts."""
    lo = hi = 0
    for n in sizes:
        chunks = [b - a for a, b in zip(chunk_bounds(n, t), chunk_bounds(n, t)[1:])]
        lo += 2 * (n - max(chunks)) * itemsize
        hi += 2 * (n - min(chunks)) * itemsize
    return lo, hi


def _bytes_problem(comm, sizes, what, words, gathered=None):
    """None when this rank sent the bytes of ring all-reduces of `sizes` elements, else a sentence."""
    t, r = comm.Get_size(), comm.Get_rank()
    lo, hi = _ring_bytes(sizes, t)
    sent = comm.bytes_sent
    if lo <= sent <= hi:
        return None
    want = f"{lo} bytes" if lo == hi else f"{lo} to {hi} bytes"
    if not sizes:
        hint = f"{words}: nothing moves in this direction"
    elif sent == 0:
        hint = f"{words}: no all-reduce went through the communicator it was given"
    elif gathered is not None and sent >= (t - 1) * gathered // t:
        hint = (f"{words}; {sent} bytes is the size of the whole logits ({gathered} bytes) gathered: "
                "never gather them, all-reduce three numbers per token")
    else:
        hint = f"{words}: {'more' if sent > hi else 'less'} than that was sent"
    return f"rank {r} sent {sent} bytes for {what}; expected {want}, {hint}"


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


def _tuple3(out, name, rank):
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise AssertionError(f"rank {rank}: {name} must return (grad_x, grad_weight, grad_bias), "
                             f"got {type(out).__name__}")
    return out


# ----------------------------------------------------------------------------- f and g

SHAPES = [(B, T, 3), (2, 3, 7), (1, 1, 1)]        # 30, 42 and 1 elements: chunks uneven at 4 and 8


def _parts(shape, n, seed):
    """Every rank's partial array (what each rank holds before a sum), from the seed."""
    return [_normal(shape, seed, k) for k in range(n)]


def check_f_forward(fn, session=None):
    with own_session(session) as s:
        r = s.rank()
        for shape in SHAPES:
            x = _normal(shape, 10)                       # the whole input, the same on every rank
            got, comm = _call(s, fn, x)
            _raise(_mismatch(got, x, f"rank {r}: f's forward of x of shape {shape}",
                             [(x * s.size(), "the sum over ranks: f's forward is the identity")]),
                   _bytes_problem(comm, [], f"f's forward of {shape}", "f's forward is the identity"))


def _check_sum(fn, session, seed, name, of, only_mine, words):
    """f's backward and g's forward are the same computation (the sum of every rank's part,
    one all-reduce), checked in each one's own words."""
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for shape in SHAPES:
            parts = _parts(shape, n, seed)
            got, comm = _call(s, fn, parts[r])
            _raise(_mismatch(got, sum(parts), f"rank {r}: {name} of {of} of shape {shape}", [(parts[r], only_mine)]),
                   _bytes_problem(comm, [int(np.prod(shape))], f"{name} of {shape}", words))
            _same_everywhere(s, got, f"{name} of {shape}")


def check_f_backward(fn, session=None):
    # rank k's part of dX: (dY_k) A_k^T
    _check_sum(fn, session, 11, "f's backward", "a gradient",
               "this rank's part only: f's backward sums the parts of all ranks", "one all-reduce of the gradient")


def check_g_forward(fn, session=None):
    # rank k's partial sum X_k A_k
    _check_sum(fn, session, 12, "g's forward", "x", "this rank's partial sum only: g's forward adds the parts",
               "one all-reduce of the activation")


def check_g_backward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for shape in SHAPES:
            grad = _normal(shape, 13)                    # dY, whole and the same on every rank
            got, comm = _call(s, fn, grad)
            _raise(_mismatch(got, grad, f"rank {r}: g's backward of a gradient of shape {shape}",
                             [(grad * n, "the sum over ranks: g's backward is the identity, the sum "
                               "happened going forward")]),
                   _bytes_problem(comm, [], f"g's backward of {shape}",
                                  "g's backward is the identity (dY is already whole on every rank)"))

# ----------------------------------------------------------------------------- the split


def check_split_for_rank(fn):
    """Serial: every (shape, axis, t, rank), uneven lengths included, against numpy.array_split."""
    rng = _rng(14)
    cases = [((6, 9), 1), ((6, 9), 0), ((7,), 0), ((4, 10), 1), ((3, 4, 5), 2), ((3, 4, 5), 1), ((2, 3), 1)]
    for shape, axis in cases:
        a = rng.standard_normal(shape)
        before = a.copy()
        for t in (1, 2, 3, 4, 8):
            for rank in range(t):
                want = np.array_split(a, t, axis=axis)[rank]
                got = fn(a, axis, rank, t)
                words = ("a column-parallel weight (in, out) is cut along axis 1, its bias along axis 0; "
                         "a row-parallel weight along axis 0")
                problem = _mismatch(got, want, f"split_for_rank(a of shape {shape}, axis={axis}, rank={rank}, "
                                               f"t={t}) (rank {rank}'s piece: numpy.array_split(a, t, axis)"
                                               f"[rank])", [])
                if problem:
                    pieces = np.array_split(a, t, axis=axis)
                    other = [k for k in range(t) if k != rank and pieces[k].shape == np.shape(got)
                             and np.array_equal(got, pieces[k])]
                    if other:
                        problem += f" (that is rank {other[0]}'s piece)"
                    elif np.shape(got) != want.shape:
                        problem += f"; {words}; the first len % t pieces are one longer"
                _raise(problem, None if np.array_equal(a, before) else
                       f"split_for_rank(a of shape {shape}, axis={axis}, rank={rank}, t={t}) changed a")

# ----------------------------------------------------------------------------- column- and row-parallel


def _linear_case(n, i, cut):
    """The whole problem: X (b, s, in), A (in, out), bias (out,), dY (b, s, out), in or out
    (whichever is cut) of 2n+1 or n+2, uneven over n ranks."""
    k = (2 * n + 1, n + 2)[i % 2]
    d_in, d_out = (5, k) if cut == "columns" else (k, 4)
    x, a = _normal((B, T, d_in), 20, i), _normal((d_in, d_out), 21, i)
    bias = _normal((d_out,), 22, i) if i < 2 else None
    dy = _normal((B, T, d_out), 23, i)
    return x, a, bias, dy


CASES = range(3)                 # with a bias (two shapes), without one


def check_column_parallel_forward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for i in CASES:
            x, a, bias, _ = _linear_case(n, i, "columns")
            y = x @ a + (0 if bias is None else bias)
            a_r = _part(a, 1, r, n)
            b_r = None if bias is None else _part(bias, 0, r, n)
            what = f"column-parallel forward, X {x.shape}, this rank's columns A_r {a_r.shape}" + \
                ("" if bias is not None else ", no bias")
            got, comm = _call(s, fn, x, a_r, b_r)
            _raise(_mismatch(got, _part(y, 2, r, n), f"rank {r}: {what}",
                             [(_part(y, 2, r, n) * n, "the sum over ranks: the columns need no sum")]),
                   _bytes_problem(comm, [], what, "f's forward is the identity: a column-parallel layer's "
                                                  "forward is local"))


def check_column_parallel_backward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for i in CASES:
            x, a, _, dy = _linear_case(n, i, "columns")
            a_r, dy_r = _part(a, 1, r, n), _part(dy, 2, r, n)
            what = f"column-parallel backward, X {x.shape}, A_r {a_r.shape}, dY_r {dy_r.shape}"
            out, comm = _call(s, fn, x, a_r, dy_r)
            gx, gw, gb = _tuple3(out, "column_parallel_backward", r)
            _raise(_mismatch(gx, dy @ a.T, f"rank {r}: grad_x of the {what}",
                             [(dy_r @ a_r.T, "this rank's part only: dX = sum over ranks of dY_r A_r^T, "
                               "all-reduce it (f's backward)")]),
                   _mismatch(gw, _part(np.einsum("bti,bto->io", x, dy), 1, r, n),
                             f"rank {r}: grad_weight of the {what}",
                             [(n * _part(np.einsum("bti,bto->io", x, dy), 1, r, n),
                               "summed over ranks: dA_r = X^T dY_r is local")]),
                   _mismatch(gb, _part(dy.sum(axis=(0, 1)), 0, r, n), f"rank {r}: grad_bias of the {what}",
                             [(n * _part(dy.sum(axis=(0, 1)), 0, r, n), "summed over ranks: db_r is local")]),
                   _bytes_problem(comm, [x.size], what, "one all-reduce of dX, the size of X"))
            _same_everywhere(s, gx, f"grad_x of the {what}")


def check_row_parallel_forward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for i in CASES:
            x, a, bias, _ = _linear_case(n, i, "rows")
            y = x @ a + (0 if bias is None else bias)
            x_r, a_r = _part(x, 2, r, n), _part(a, 0, r, n)
            what = f"row-parallel forward, X_r {x_r.shape}, A_r {a_r.shape}" + \
                (f", bias {bias.shape}" if bias is not None else ", no bias")
            got, comm = _call(s, fn, x_r, a_r, bias)
            hints = [(x_r @ a_r + (0 if bias is None else bias), "this rank's partial sum: all-reduce X_r A_r "
                      "(g's forward)")]
            if bias is not None:
                hints.append((y + (n - 1) * bias, f"the bias counted {n} times: add it once, after the sum"))
            _raise(_mismatch(got, y, f"rank {r}: {what}", hints),
                   _bytes_problem(comm, [y.size], what, "one all-reduce of Y, the layer's output"))
            _same_everywhere(s, got, what)


def check_row_parallel_backward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for i in CASES:
            x, a, _, dy = _linear_case(n, i, "rows")
            x_r, a_r = _part(x, 2, r, n), _part(a, 0, r, n)
            what = f"row-parallel backward, X_r {x_r.shape}, A_r {a_r.shape}, dY {dy.shape}"
            out, comm = _call(s, fn, x_r, a_r, dy)
            gx, gw, gb = _tuple3(out, "row_parallel_backward", r)
            _raise(_mismatch(gx, dy @ a_r.T, f"rank {r}: grad_x of the {what}",
                             [(n * (dy @ a_r.T), "summed over ranks: dX_r = dY A_r^T is this rank's columns, "
                               "local")]),
                   _mismatch(gw, _part(np.einsum("bti,bto->io", x, dy), 0, r, n),
                             f"rank {r}: grad_weight of the {what}", []),
                   _mismatch(gb, dy.sum(axis=(0, 1)), f"rank {r}: grad_bias of the {what}",
                             [(n * dy.sum(axis=(0, 1)), "summed over ranks: dY is already whole, db is local")]),
                   _bytes_problem(comm, [], what, "g's backward is the identity: a row-parallel layer's "
                                                  "backward is local"))

# ----------------------------------------------------------------------------- the vocabulary-parallel loss


def _vocab_case(n, i):
    """The whole problem for n ranks: (logits (N, V_padded), targets (N,), V, per rank)."""
    V = (5 * n - 2, 3 * n + 1)[i]                        # padded to a multiple of n; at 8 ranks the
    per = tp.padded_vocab(V, n) // n                     # last rank of case 1 holds padding only
    rng = _rng(30, i, n)
    logits = rng.standard_normal((B * T, per * n)) * 3.0
    logits[0] += 1000.0                                  # exp(1000) overflows: shift by the max first
    logits[1, V:] = 50.0                                 # padded columns must count as -inf
    targets = rng.integers(0, V, size=B * T)
    edges = sorted({min(k * per, V - 1) for k in range(n)} | {min(k * per + per - 1, V - 1) for k in range(n)})
    targets[:min(len(edges), len(targets))] = edges[:len(targets)]   # every range's first and last id
    return logits, targets, V, per


def _softmax_loss(logits, targets, V):
    z = logits[:, :V]
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=1, keepdims=True)
    loss = float(np.mean(np.log(s[:, 0]) + m[:, 0] - z[np.arange(len(targets)), targets]))
    probs = np.zeros_like(logits)
    probs[:, :V] = e / s
    return loss, probs


def check_vocab_parallel_cross_entropy_forward(fn, session=None):
    with own_session(session) as s:
        r, n = s.rank(), s.size()
        for i in range(2):
            logits, targets, V, per = _vocab_case(n, i)
            lo = r * per
            loss, probs = _softmax_loss(logits, targets, V)
            mine = _part(logits, 1, r, n)
            what = (f"vocab-parallel loss, N = {len(targets)} tokens, vocabulary {V} padded to {per * n}, "
                    f"this rank's columns [{lo}, {lo + per})")
            out, comm = _call(s, fn, mine, targets.copy(), lo, V)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise AssertionError(f"rank {r}: vocab_parallel_cross_entropy_forward must return (loss, probs), "
                                     f"got {type(out).__name__}")
            got_loss, got_probs = out
            _raise(_mismatch(np.asarray(got_loss, dtype=np.float64).reshape(()) if np.size(got_loss) == 1
                             else got_loss, np.float64(loss), f"rank {r}: the loss of the {what}", []),
                   _mismatch(got_probs, _part(probs, 1, r, n), f"rank {r}: probs of the {what}", []),
                   _bytes_problem(comm, [len(targets)] * 3, what, f"three all-reduces of N = {len(targets)} numbers "
                                  "(the max, the target's logit, the sum of exponentials)",
                                  gathered=logits[:, :per * n].nbytes))
            _same_everywhere(s, np.asarray(got_loss, dtype=np.float64), f"the loss of the {what}")


def check_vocab_parallel_cross_entropy_backward(fn):
    """Serial (it is local): every rank of 1, 2, 3, 4 and 8, both vocabularies."""
    for n in (1, 2, 3, 4, 8):
        for i in range(2):
            logits, targets, V, per = _vocab_case(n, i)
            _, probs = _softmax_loss(logits, targets, V)
            onehot = np.zeros_like(probs)
            onehot[np.arange(len(targets)), targets] = 1.0
            grad = 0.7
            want = (probs - onehot) * grad / len(targets)
            for r in range(n):
                p_r, lo = _part(probs, 1, r, n), r * per
                args = (p_r, targets.copy(), lo, grad)
                before = [p_r.copy(), targets.copy()]
                got = fn(*args)
                what = (f"vocab-parallel loss backward for rank {r} of a group of {n}, columns [{lo}, {lo + per}) of a "
                        f"vocabulary of {V} padded to {per * n}, grad {grad}")
                _raise(_mismatch(got, _part(want, 1, r, n), what,
                                 [(_part(probs * grad / len(targets), 1, r, n), "the one-hot of the targets is "
                                   "missing"), (_part(probs - onehot, 1, r, n), "not scaled by grad / N")]),
                       _unchanged(args[:2], before, "vocab_parallel_cross_entropy_backward", r))


EXERCISES = [
    Exercise("3.1", "f_forward", tp.f_forward, check_f_forward, MIN_RANKS),
    Exercise("3.2", "f_backward", tp.f_backward, check_f_backward, MIN_RANKS),
    Exercise("3.3", "g_forward", tp.g_forward, check_g_forward, MIN_RANKS),
    Exercise("3.4", "g_backward", tp.g_backward, check_g_backward, MIN_RANKS),
    Exercise("3.5", "split_for_rank", tp.split_for_rank, check_split_for_rank),
    Exercise("3.6", "column_parallel_forward", tp.column_parallel_forward, check_column_parallel_forward, MIN_RANKS),
    Exercise("3.7", "column_parallel_backward", tp.column_parallel_backward, check_column_parallel_backward,
             MIN_RANKS),
    Exercise("3.8", "row_parallel_forward", tp.row_parallel_forward, check_row_parallel_forward, MIN_RANKS),
    Exercise("3.9", "row_parallel_backward", tp.row_parallel_backward, check_row_parallel_backward, MIN_RANKS),
    Exercise("3.10", "vocab_parallel_cross_entropy_forward", tp.vocab_parallel_cross_entropy_forward,
             check_vocab_parallel_cross_entropy_forward, MIN_RANKS),
    Exercise("3.11", "vocab_parallel_cross_entropy_backward", tp.vocab_parallel_cross_entropy_backward,
             check_vocab_parallel_cross_entropy_backward),
]
