"""Checks for lessons/exercises/09_moe.py: routing with capacity, and the all-to-all.

- 9.1 route(probs, top_k, capacity), serial: hand-made groups whose answer can be read off
  (ties between experts, an expert over capacity, a token's second choice competing with
  other tokens' first), then groups of quantised probabilities full of ties, E = 4, 8 and
  64, top-1 and top-2, with and without capacity. The answer comes from a referee written
  here again, as plainly as the rule reads (sorted() with keys), only after the student's
  function has returned; probs must be left unchanged, and earlier results too.
- 9.2 all_to_all_v(comm, send_chunks), under mpirun on a counting communicator that
  refuses collectives: chunks of every length from 0 up (a rank that sends nothing, one
  that sends only to itself), rows of several shapes and dtypes, a large chunk (above MPI's
  eager limit, so a Send that waits for its Recv shows a deadlock), on the world and again
  on groups of N-1 ranks and of 1. Each rank must get, from every rank i, exactly the rows i
  meant for it, in order, in the dtype sent, in new arrays (none sharing memory with an
  input: its own chunk copied, not returned as it is); send the rows to other ranks once
  (plus a few int64 counts), its own chunk not through MPI; and leave its inputs unchanged.
"""
import numpy as np

from minidist import moe
from minidist.comm import p2p
from minidist.grader.checks import Exercise, own_session, world_then_groups, yours
from minidist.grader.checks.ex01_collectives import Kept, _call, _short
from minidist.grader.plugin import Run

BIG = 40_000        # rows of one float64 in the large case: 320 KB, above MPI's eager limit
MIN_RANKS = 3       # at 2 ranks, rank + k and rank - k are the same rank: a wrong pairing passes


# ----------------------------------------------------------------------------- 9.1 route

def referee_route(probs, top_k, capacity):
    """The rule as it reads: each token's top_k experts by probability, the lower index first
    on a tie; then each expert keeps `capacity` of the choices made for it, the highest
    probabilities first, the lower token index first on a tie."""
    T, E = probs.shape
    experts = np.array([sorted(range(E), key=lambda e: (-probs[t, e], e))[:top_k] for t in range(T)],
                       dtype=np.int64).reshape(T, top_k)
    keep = np.ones((T, top_k), dtype=bool)
    if capacity is not None:
        for e in range(E):
            choices = [(t, k) for t in range(T) for k in range(top_k) if experts[t, k] == e]
            ranked = sorted(choices, key=lambda tk: (-probs[tk[0], e], tk[0]))
            for t, k in ranked[capacity:]:
                keep[t, k] = False
    return experts, keep


def _quantised(seed, T, E):
    """Probabilities in steps of 1/16 (many ties), each row summing to about one."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 6, size=(T, E)).astype(np.float64) + 1e-3 * (g.random((T, E)) < 0.0)
    return raw / 16.0


HAND = [
    # ties between experts: the lower index first
    (np.array([[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.4, 0.1]]), 2, None, "ties between experts"),
    # expert 0 over capacity 2: tokens 1 and 3 have its highest probabilities
    (np.array([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.6, 0.1, 0.3]]), 1, 2,
     "expert 0 over capacity"),
    # equal probabilities for one expert: the lower token index is kept
    (np.array([[0.6, 0.4], [0.6, 0.4], [0.6, 0.4]]), 1, 2, "tokens tied for one expert"),
    # a second choice (0.45) outranks other tokens' first choices (0.4) for expert 1
    (np.array([[0.5, 0.45, 0.05], [0.3, 0.4, 0.3], [0.2, 0.4, 0.4]]), 2, 1, "a second choice against first ones"),
]


def _route_cases():
    for probs, k, cap, what in HAND:
        yield probs, k, cap, what
    for E in (4, 8, 64):
        for k in (1, 2):
            T = 40
            probs = _quantised(E * 10 + k, T, E)
            cap = moe.expert_capacity(T, k, E, 1.0)
            yield probs, k, None, f"T={T} E={E} top_{k}, dropless"
            yield probs, k, cap, f"T={T} E={E} top_{k}, capacity {cap}"
            yield probs, k, max(1, cap // 3), f"T={T} E={E} top_{k}, capacity {max(1, cap // 3)}"


def _route_problem(got, probs, k, cap, what):
    """None when got is route's answer, else a sentence."""
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"{what}: return (experts, keep), two arrays; got {type(got).__name__}"
    experts, keep = (np.asarray(a) for a in got)
    T, E = probs.shape
    if experts.shape != (T, k) or keep.shape != (T, k):
        return f"{what}: experts and keep must have shape ({T}, {k}); got {experts.shape} and {keep.shape}"
    if experts.dtype.kind not in "iu":
        return f"{what}: experts must be integers (expert indices), got dtype {experts.dtype.name}"
    if keep.dtype != bool:
        return f"{what}: keep must be a bool array, got dtype {keep.dtype.name}"
    want_e, want_k = referee_route(probs, k, cap)
    for t in range(T):
        if list(experts[t]) != list(want_e[t]):
            row = probs[t]
            tie = len(set(row[want_e[t]])) < k or any(row[e] == row[want_e[t, -1]] for e in range(E)
                                                       if e not in want_e[t])
            return (f"{what}: token {t} (probabilities {_short(row)}) got experts {list(map(int, experts[t]))}, "
                    f"expected {list(map(int, want_e[t]))}: the top {k} by probability, highest first"
                    + ("; on a tie the lower expert index first (a stable sort of -probs)" if tie else ""))
    if cap is None:
        if not keep.all():
            return f"{what}: without a capacity (None) every choice is kept; you dropped {int((~keep).sum())}"
        return None
    for e in range(E):
        mine = {(t, j) for t in range(T) for j in range(k) if experts[t, j] == e}
        kept = {tj for tj in mine if keep[tj]}
        want = {tj for tj in mine if want_k[tj]}
        if kept == want:
            continue
        in_order = set(sorted(mine)[:cap])
        hint = ("you kept them in token order: keep the highest probabilities" if kept == in_order else
                f"an expert keeps exactly min(capacity, choices) = {len(want)}: an off-by-one?"
                if len(kept) != len(want) else
                "the highest probabilities win, the lower token index on a tie; all k choices compete")
        extra, missing = sorted(kept - want), sorted(want - kept)
        return (f"{what}: expert {e} (capacity {cap}, {len(mine)} choices) kept {len(kept)}: "
                + (f"choices (token, slot) {extra[:3]} should be dropped" if extra else "")
                + ("; " if extra and missing else "")
                + (f"{missing[:3]} should be kept" if missing else "") + f" ({hint})")
    return None


def check_route(fn):
    kept = []
    for probs, k, cap, what in _route_cases():
        before = probs.copy()
        got = yours(fn, probs, k, cap)
        if not np.array_equal(probs, before):
            raise AssertionError(f"{what}: route changed probs; the router's probabilities are read, never written")
        problem = _route_problem(got, probs, k, cap, what)
        if problem:
            raise AssertionError(problem)
        kept.append((what, [np.asarray(a) for a in got], [np.array(a, copy=True) for a in got]))
        for was, arrays, copies in kept[:-1]:
            if any(not np.array_equal(a, c) for a, c in zip(arrays, copies)):
                raise AssertionError(f"the (experts, keep) route returned for {was} changed when it was called again "
                                     f"({what}): return new arrays on every call")


# ----------------------------------------------------------------------------- 9.2 all_to_all_v

def _rows(src, dst, n, case, seed):
    """The rows rank `src` sends to rank `dst` in one case: deterministic, of every length."""
    count, shape, dtype = case
    length = count(src, dst, n)
    g = np.random.default_rng([seed, src, dst, length])
    a = g.integers(-99, 100, size=(length,) + shape) if np.dtype(dtype).kind == "i" else \
        g.standard_normal((length,) + shape)
    return a.astype(dtype)


CASES_V = [
    (lambda s, d, n: (s + 2 * d) % 4, (3,), np.float64),          # 0..3 rows, some empty
    (lambda s, d, n: 0 if s == n - 1 else s + d + 1, (), np.float32),   # the last rank sends nothing
    (lambda s, d, n: 2 if s == d else 0, (2, 2), np.int32),       # only to itself
    (lambda s, d, n: (s * n + d) % 5 + 1, (4,), np.float32),
    (lambda s, d, n: BIG if (s, d) == (0, n - 1) else 1, (), np.float64),   # one large chunk
    (lambda s, d, n: (s + 2 * d) % 4, (3,), np.float64),          # the first case's shapes, other values
]


def _all_to_all_cases(fn, s, seed=7):
    n, r = s.size(), s.rank()
    kept = Kept("all_to_all_v", r)
    for i, case in enumerate(CASES_V):
        send = [_rows(r, d, n, case, seed + i) for d in range(n)]
        before = [c.copy() for c in send]
        what = f"case {i + 1} ({np.dtype(case[2]).name}, rows of shape {case[1]})"
        got, comm = _call(s, fn, send)
        for d, (c, b) in enumerate(zip(send, before)):
            if not np.array_equal(c, b):
                raise AssertionError(f"rank {r}, {what}: all_to_all_v changed send_chunks[{d}]; leave the input as it is")
        if not isinstance(got, (list, tuple)) or len(got) != n:
            raise AssertionError(f"rank {r}, {what}: return a list of {n} arrays (one from each rank), got "
                                 f"{type(got).__name__}" + (f" of {len(got)}" if hasattr(got, '__len__') else ""))
        for src, g in enumerate(got):
            shared = [d for d, c in enumerate(send) if isinstance(g, np.ndarray) and np.shares_memory(g, c)]
            if shared:
                raise AssertionError(f"rank {r}, {what}: the array returned from rank {src} shares memory with "
                                     f"send_chunks[{shared[0]}], the caller's own array"
                                     + (" (your own chunk returned as it is: copy it, so that the caller may "
                                        "reuse its send buffers)" if src == r == shared[0] else "")
                                     + ": return new arrays")
        for src in range(n):
            want = _rows(src, r, n, case, seed + i)            # the answer, only now
            g = np.asarray(got[src])
            if g.shape != want.shape:
                raise AssertionError(f"rank {r}, {what}: from rank {src} got {g.shape[0] if g.ndim else '?'} rows of "
                                     f"shape {g.shape[1:]}, expected {want.shape[0]} of shape {want.shape[1:]}"
                                     + (" (your own chunk stays with you: copy it)" if src == r else
                                        " (at step k, send to rank r+k and receive from rank r-k: who sends to whom?)"))
            if g.dtype != want.dtype:
                raise AssertionError(f"rank {r}, {what}: from rank {src} got dtype {g.dtype.name}, sent "
                                     f"{want.dtype.name}: receive into a buffer of the rows' dtype")
            if not np.array_equal(g, want):
                raise AssertionError(f"rank {r}, {what}: the rows from rank {src} are {_short(g)}, expected "
                                     f"{_short(want)}")
            kept.add(f"{what}, from rank {src}", g)
        data = sum(c.nbytes for d, c in enumerate(send) if d != r)
        extra = comm.bytes_sent - data
        if not 0 <= extra <= 8 * (n - 1) * 2:
            hint = ("fewer than the rows it had to send" if extra < 0 else
                    "your own chunk went through MPI: copy it instead" if extra >= send[r].nbytes > 0 else
                    "more than the rows plus a count for each rank: is something sent twice?")
            raise AssertionError(f"rank {r}, {what}: sent {comm.bytes_sent} bytes; the rows for other ranks are "
                                 f"{data} bytes, plus at most {8 * (n - 1) * 2} bytes of counts ({hint})")
        kept.look(what)
    kept.report()


def check_all_to_all_v(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _all_to_all_cases(fn, s))


def _values_match(report):
    """Lesson 09's values verdict. Its bytes verdict counts what the package's all_to_all_v
    reports to minidist.comm.stats, which a student's does not; the unit check holds 9.2 to
    the bytes."""
    return report["max_rel_diff"] <= report["tolerance"]


SMALL = ("--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--steps", "2")
# 9.1: both sides of lesson 09 route with your function, so this run proves it works inside
# the model (shapes, dtypes, every call); the unit check above is what holds it to the rule.
# Under --drop-policy probs your capacity rule decides the drops too (position, the lesson's
# default, asks route only for each token's top k).
ROUTE_RUNS = (Run("09_moe", SMALL + ("--drop-policy", "probs"), ranks=1),)
# 9.2: expert parallelism on every graded rank moves the tokens with your all-to-all; one
# process (no all-to-all) is the reference.
A2A_RUNS = (Run("09_moe", SMALL, judge=_values_match),)

EXERCISES = [
    Exercise("9.1", "route", moe.route, check_route, runs=ROUTE_RUNS),
    Exercise("9.2", "all_to_all_v", p2p.all_to_all_v, check_all_to_all_v, MIN_RANKS, groups=True,
             why_ranks="at 2 ranks, rank + k and rank - k are the same rank, so a wrong pairing would pass;",
             runs=A2A_RUNS),
]
