"""Checks for lessons/exercises/13_context_parallel.py: the log-sum-exp merge, the chunks a
rank holds, and one ring step.

Each function is compared with a referee written here again, as plainly as the rule
reads, and only after the student's function has returned; inputs must come back
unchanged, earlier results too (a buffer kept between calls and returned again changes
under the caller's feet).

- 13.1 merge_partials(o1, lse1, o2, lse2), serial: random float64 partial results of
  shapes (B, nh, T, hs) / (B, nh, T), rows that saw no key on one side, on the other and
  on both (lse -inf: the merge must give the other side, or lse -inf and o = 0, never
  nan), a first ring step against an empty result (all of one side -inf), ties, large
  log-sum-exps (+-800: exp overflows and underflows in float64, so the merge must shift
  by the larger one first), a view as input, float32 inputs. Held to 1e-12 of the
  referee in float64 (a detour through float32 is 1e-7 off) and 1e-5 in float32; the
  dtype must be the inputs', the arrays new.
- 13.2 rank_chunks(rank, cp, load_balance), serial: every rank of cp = 1 .. 8 and 16, both
  layouts and the default (load-balanced), against [r, 2cp-1-r] and [2r, 2r+1]; Python
  (or NumPy) ints, in that order; and over a cp's ranks every chunk 0 .. 2cp-1 once.
- 13.3 ring_pass_start(comm, send_arrays, recv_arrays, tag), under mpirun on a counting
  communicator that refuses collectives and pickling (minidist/grader/counting.py) and
  notes every Isend and Irecv: one to five arrays of several dtypes and shapes (an empty
  one too), lengths that differ from rank to rank (uneven chunks), a large case (above
  MPI's eager limit), a second call with new buffers, on the world and on groups of N-1
  ranks and of 1. Right after the call, before anything is waited for: no blocking call;
  each array sent once with Isend to (rank + 1) % n and received with Irecv from
  (rank - 1) % n straight into the caller's buffer, with the given tag; every request
  returned, as [recv 0, send 0, recv 1, send 1, ...] (the package's ring backward takes
  requests[0::2] for the receives). This is agreed by every rank (each learns the lowest
  rank's finding and raises it, after taking back the misrouted messages), so a
  misrouted ring fails at once in words instead of hanging, with or without the grader.
  Then the check waits on the requests (stoppable): every receive buffer must hold the
  left neighbour's arrays, the send buffers unchanged, earlier calls' buffers too. Last,
  two exchanges of large arrays in flight at once (tags of their own, started in
  opposite orders on odd ranks), the ranks calling one after another from rank 0 up,
  each once the rank to its left has returned from both calls: a ring_pass_start that
  waits for its own messages never returns there, which the grader reports as FAIL after
  its timeout (Send waits for its Recv here at any size, as MPI's does for large
  messages, so a blocking ring deadlocks the same way); and since the right neighbour
  has not posted its receives when a rank sends, a large message waits for them, so data
  sent out of a staging buffer that the second call overwrote arrives overwritten.

Then the plug-in check runs lesson 13 with the function plugged into the package
(minidist.grader.plugin): the ring variant, cp = every graded rank, at a sequence length
that does not divide into the 2 cp chunks; it merges every arriving block with
merge_partials, lays the sequence out with rank_chunks (load-balanced, and naive for
13.2) and passes K, V forward and K, V, dK, dV backward with ring_pass_start. 13.1 and
13.2 are held to the lesson's whole verdict (values, and every rank's tiles and bytes
against plan/context.py's counts); 13.3 to its values, since the bytes the lesson counts
are those the package's own ring_pass_start reports.
"""
import numpy as np
from mpi4py import MPI

from minidist import attention
from minidist.grader.checks import Exercise, own_session, world_then_groups, yours
from minidist.grader.checks.ex01_collectives import Kept, _short
from minidist.grader.counting import CountingComm, Misuse
from minidist.grader.plugin import Run
from minidist.grader.referee import said
from minidist.parallel import context_parallel

TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
REFUSE = "use comm.Isend and comm.Irecv: one ring step is point-to-point, to the neighbours"
BIG = 40_000        # float64 elements of one array in the large case: 320 KB, above MPI's eager limit
MIN_RANKS = 3       # at 2 ranks left and right are the same rank: a ring turned the wrong way passes
NOTE_BYTES = 1000   # a rank's finding, as the ranks agree on it
TURN_TAG = 31001    # the check's own turns (the last case), on the session's referee communicator


# ----------------------------------------------------------------------------- 13.1 merge_partials

def referee_merge(o1, lse1, o2, lse2):
    """The merge as it reads, in float64: shift by the larger lse, weigh, normalise.
    Rows where both sides are -inf: lse -inf, o 0."""
    a, b = np.asarray(lse1, np.float64), np.asarray(lse2, np.float64)
    m = np.maximum(a, b)
    seen = m > -np.inf
    shift = np.where(seen, m, 0.0)
    w1, w2 = np.exp(a - shift), np.exp(b - shift)         # exp(-inf) = 0: a side that saw nothing
    total = np.where(seen, w1 + w2, 1.0)                  # at least 1 where a key was seen
    lse = np.where(seen, shift + np.log(total), -np.inf)
    s1, s2 = np.where(seen, w1 / total, 0.0), np.where(seen, w2 / total, 0.0)
    o = s1[..., None] * np.asarray(o1, np.float64) + s2[..., None] * np.asarray(o2, np.float64)
    return o, lse


def _side(g, shape, centre, spread, dtype):
    """One partial result: o (B, nh, T, hs) as a softmax-weighted mean of values is, lse around centre."""
    o = g.standard_normal(shape)
    lse = centre + spread * g.standard_normal(shape[:-1])
    return o.astype(dtype), lse.astype(dtype)


def _empty_rows(o, lse, rows):
    """Rows (a boolean mask over (B, nh, T)) that saw no key: lse -inf and o 0, as the engine gives them."""
    lse[rows] = -np.inf
    o[rows] = 0


def _merge_cases():
    """(o1, lse1, o2, lse2, what), made fresh for each call."""
    g = np.random.default_rng(13)
    f64 = np.float64
    for shape in [(2, 3, 5, 4), (1, 1, 1, 1), (1, 2, 7, 8), (3, 1, 4, 16)]:
        yield (*_side(g, shape, 0.0, 3.0, f64), *_side(g, shape, 0.0, 3.0, f64)), f"random, shape {shape}"
    shape = (2, 2, 9, 4)
    o1, l1 = _side(g, shape, 1.0, 2.0, f64)
    o2, l2 = _side(g, shape, 1.0, 2.0, f64)
    rows = g.random(shape[:-1])
    _empty_rows(o1, l1, rows < 0.25)                       # side 1 saw nothing
    _empty_rows(o2, l2, (rows >= 0.25) & (rows < 0.5))     # side 2 saw nothing
    _empty_rows(o1, l1, rows >= 0.75)
    _empty_rows(o2, l2, rows >= 0.75)                      # neither side saw a key
    yield (o1, l1, o2, l2), "rows that saw no key on side 1, on side 2, and on both (lse -inf)"
    o1 = np.zeros(shape)
    l1 = np.full(shape[:-1], -np.inf)
    yield (o1, l1, *_side(g, shape, 0.5, 2.0, f64)), "the first step: the result so far is empty (lse1 all -inf)"
    o1, l1 = _side(g, shape, 0.0, 2.0, f64)
    o2 = np.zeros(shape)
    yield (o1, l1, o2, np.full(shape[:-1], -np.inf)), "a block that no query sees (lse2 all -inf)"
    o1, l1 = _side(g, shape, 0.0, 2.0, f64)
    yield (o1, l1, g.standard_normal(shape), l1.copy()), "equal lse on both sides"
    for centre in (800.0, -800.0):
        o1, l1 = _side(g, shape, centre, 5.0, f64)
        o2, l2 = _side(g, shape, centre, 5.0, f64)
        yield (o1, l1, o2, l2), f"large log-sum-exps (around {centre:+g}: exp() of them over- or underflows)"
    o1, l1 = _side(g, shape, 0.0, 2.0, f64)
    o2, l2 = _side(g, shape, 30.0, 2.0, f64)
    yield (o1, l1, o2, l2), "one side far heavier than the other (lse2 about lse1 + 30)"
    wide_o, wide_l = _side(g, (2, 2, 18, 4), 0.0, 2.0, f64)
    yield (wide_o[:, :, ::2], wide_l[:, :, ::2], *_side(g, shape, 0.0, 2.0, f64)), "o1 and lse1 strided views"
    for shape in [(2, 3, 5, 4), (1, 2, 6, 8)]:
        o1, l1 = _side(g, shape, 0.0, 3.0, np.float32)
        o2, l2 = _side(g, shape, 0.0, 3.0, np.float32)
        _empty_rows(o2, l2, g.random(shape[:-1]) < 0.3)
        yield (o1, l1, o2, l2), f"float32, shape {shape}, some rows of side 2 -inf"
    yield (*_side(g, (2, 3, 5, 4), 0.0, 3.0, f64), *_side(g, (2, 3, 5, 4), 0.0, 3.0, f64)), \
        "the first case's shapes again, other values"


def _merge_problem(got, args, what):
    """None when got is the merge of args, else a sentence."""
    o1, lse1, o2, lse2 = args
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return f"{what}: return (o, lse), two arrays; got {type(got).__name__}"
    o, lse = got
    if not isinstance(o, np.ndarray) or not isinstance(lse, np.ndarray):
        return f"{what}: return (o, lse) as NumPy arrays; got ({type(o).__name__}, {type(lse).__name__})"
    if o.shape != o1.shape or lse.shape != lse1.shape:
        return f"{what}: got o of shape {o.shape} and lse of shape {lse.shape}, expected {o1.shape} and {lse1.shape}"
    dtype = o1.dtype
    if o.dtype != dtype or lse.dtype != dtype:
        return (f"{what}: got o {o.dtype.name} and lse {lse.dtype.name} from {dtype.name} inputs: keep the inputs' "
                "dtype (float64 all the way: no float32 step in between)")
    for name, a in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        if np.shares_memory(o, a) or np.shares_memory(lse, a):
            return f"{what}: a returned array shares memory with {name}: return new arrays"
    want_o, want_lse = referee_merge(o1, lse1, o2, lse2)
    tol = TOL[dtype]
    bad_lse = np.isnan(lse) | (np.isneginf(want_lse) != np.isneginf(lse)) | np.isposinf(lse)
    finite = np.isfinite(want_lse) & np.isfinite(lse)
    bad_lse |= finite & (np.abs(np.where(finite, lse, 0) - np.where(finite, want_lse, 0))
                         > tol * np.maximum(1.0, np.abs(np.where(finite, want_lse, 0))))
    scale = max(float(np.max(np.abs(want_o), initial=0.0)), 1.0)
    bad_o = np.isnan(o).any(axis=-1) | (np.abs(o.astype(np.float64) - want_o) > tol * scale).any(axis=-1)
    for bad, name in ((bad_lse, "lse"), (bad_o, "o")):
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            l1, l2 = float(lse1[at]), float(lse2[at])
            row = (f"{what}: row (b, h, t) = {at} with lse1 = {l1:.6g}, lse2 = {l2:.6g}: got lse {float(lse[at]):.8g}"
                   f", expected {float(want_lse[at]):.8g}")
            if name == "o":
                row += f"; got o {_short(o[at])}, expected {_short(want_o[at])}"
            return row + _merge_hint(o[at], want_o[at], float(lse[at]), float(want_lse[at]), l1, l2, name, dtype)
    return None


def _merge_hint(o, want_o, lse, want, l1, l2, which, dtype):
    """Why a row is wrong, when the numbers show it."""
    if np.isnan(o).any() or np.isnan(lse):
        if l1 == -np.inf or l2 == -np.inf:
            return (" (nan where a side is -inf: exp(-inf - (-inf)) is nan; rows where both sides saw no key give "
                    "lse -inf and o 0, and a side with lse -inf weighs 0)")
        return " (nan: exp() overflowed? shift by max(lse1, lse2) before exponentiating)"
    if np.isinf(lse) and np.isfinite(want):
        return (" (inf or -inf where a key was seen: exp() of a large or very negative lse over- or underflows; "
                "shift by max(lse1, lse2) first: lse = m + log(exp(lse1 - m) + exp(lse2 - m)))")
    near = (abs(lse - want) <= 1e-5 * max(1.0, abs(want)) if which == "lse" else
            float(np.max(np.abs(o - want_o))) <= 1e-5 * max(1.0, float(np.max(np.abs(want_o)))))
    if dtype == np.float64 and np.isfinite(want) and near:
        return (" (off in the 7th or 8th digit, float32's precision: computed in float32 on the way? keep float64 "
                "all the way, as the lesson's float64 run compares to 1e-10)")
    if which == "lse" and np.isfinite(want) and l1 > -np.inf and l2 > -np.inf:
        for base, name in ((2.0, "base 2"), (10.0, "base 10")):
            if np.isclose(lse, np.logaddexp(l1 * np.log(base), l2 * np.log(base)) / np.log(base), rtol=1e-9):
                return f" (that is the log-sum-exp in {name}: lse is a natural logarithm, log(exp(lse1) + exp(lse2)))"
        if np.isclose(lse, max(l1, l2), rtol=1e-12):
            return " (that is max(lse1, lse2): the merged lse is log(exp(lse1) + exp(lse2)), above both)"
    if which == "o":
        return (" (o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2: each side weighed by its share of the softmax mass, "
                "not a plain sum or mean)")
    return " (lse = log(exp(lse1) + exp(lse2)), the natural logarithm)"


def check_merge_partials(fn):
    kept = Kept("merge_partials", 0)
    for args, what in _merge_cases():
        before = [a.copy() for a in args]
        with np.errstate(all="ignore"):
            got = yours(fn, *args)
        for name, a, b in zip(("o1", "lse1", "o2", "lse2"), args, before):
            if not np.array_equal(a, b, equal_nan=True):
                raise AssertionError(f"{what}: merge_partials changed its input {name}; the ring still needs it "
                                     "(write the result into new arrays)")
        problem = _merge_problem(got, args, what)
        if problem:
            raise AssertionError(problem)
        kept.add(f"{what} (o)", got[0])
        kept.add(f"{what} (lse)", got[1])
        kept.look(what)
    if kept.found:
        raise AssertionError(kept.found.replace("rank 0: ", "", 1))


# ----------------------------------------------------------------------------- 13.2 rank_chunks

def referee_chunks(rank, cp, load_balance=True):
    return [rank, 2 * cp - 1 - rank] if load_balance else [2 * rank, 2 * rank + 1]


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _chunks_hint(got, rank, cp, load_balance):
    want, other = referee_chunks(rank, cp, load_balance), referee_chunks(rank, cp, not load_balance)
    if sorted(got) == sorted(want):
        return (" (the right chunks in the wrong order: a rank's tokens, and their positions, follow the order "
                "of its chunks, the lower one first)")
    if got == other:
        return (f" (that is the {'naive' if load_balance else 'load-balanced'} layout: load_balance={load_balance} "
                f"holds {'[r, 2cp-1-r]' if load_balance else '[2r, 2r+1]'})")
    if load_balance and got == [rank, 2 * cp - rank]:
        return " (off by one: the 2cp chunks are numbered 0 .. 2cp-1, so the partner of chunk r is 2cp-1-r)"
    if load_balance and got == [rank, cp - 1 - rank]:
        return " (the sequence is cut into 2cp chunks, not cp: the partner of chunk r is 2cp-1-r)"
    if not load_balance and got == [rank, rank + 1]:
        return " (rank r holds two chunks: 2r and 2r+1)"
    return ""


def check_rank_chunks(fn):
    for cp in (*range(1, 9), 16):
        for load_balance in (True, False, None):
            held = []
            for rank in range(cp):
                got = yours(fn, rank, cp) if load_balance is None else \
                    yours(lambda *a: fn(*a, load_balance=load_balance), rank, cp)
                lb = True if load_balance is None else load_balance
                what = (f"rank_chunks({rank}, {cp}" + ("" if load_balance is None else f", load_balance={lb}") + ")")
                if not isinstance(got, (list, tuple)) or not all(_is_int(v) for v in got):
                    kinds = type(got).__name__ if not isinstance(got, (list, tuple)) else \
                        "a list of " + ", ".join(sorted({type(v).__name__ for v in got}))
                    raise AssertionError(f"{what} returned {got!r} ({kinds}): return a list of chunk indices, ints")
                got = [int(v) for v in got]
                want = referee_chunks(rank, cp, lb)
                if got != want:
                    default = " (called without load_balance: the default is True)" if load_balance is None else ""
                    raise AssertionError(f"{what} returned {got}, expected {want}{default}"
                                         + _chunks_hint(got, rank, cp, lb))
                held += got
            if sorted(held) != list(range(2 * cp)):
                raise AssertionError(f"cp = {cp}: the ranks' chunks {held} do not cover 0 .. {2 * cp - 1} once each")


# ----------------------------------------------------------------------------- 13.3 ring_pass_start

class RingComm(CountingComm):
    """The counting communicator, noting each Isend and Irecv (peer, tag, buffer, request) and
    each blocking call, so that the check can read the ring's routes before it waits."""

    def __init__(self, session):
        super().__init__(session, REFUSE)
        self.isends, self.irecvs, self.blocking = [], [], []

    def Isend(self, buf, dest, tag=0):
        req = super().Isend(buf, dest, tag)
        self.isends.append((dest, tag, buf, req))
        return req

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        req = super().Irecv(buf, source, tag)
        self.irecvs.append((source, tag, buf, req))
        return req

    def Send(self, buf, dest, tag=0):
        self.blocking.append("Send")
        super().Send(buf, dest, tag)

    def Ssend(self, buf, dest, tag=0):
        self.blocking.append("Ssend")
        super().Ssend(buf, dest, tag)

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        self.blocking.append("Recv")
        super().Recv(buf, source, tag, status)

    def Sendrecv(self, *args, **kwargs):
        self.blocking.append("Sendrecv")
        super().Sendrecv(*args, **kwargs)


def _buffer(buf):
    """The NumPy array of an mpi4py buffer argument: `a`, `[a, MPI.DOUBLE]` or `[a, n, MPI.DOUBLE]`."""
    return np.asarray(buf[0] if isinstance(buf, (list, tuple)) else buf)


def _address(a):
    return a.__array_interface__["data"][0] if a.size else None


# Each case: its tag, and the arrays rank `src` sends: [(shape, dtype)], shapes that may depend
# on src (uneven chunks), so that a rank's receive buffers are sized for its left neighbour's.
CASES = [
    ("one float64 array (B, nh, T, hs)", 7, lambda src: [((2, 3, 5, 4), np.float64)]),
    ("K and V, T of the sending rank's chunk (uneven: 3 + rank % 2)", 11,
     lambda src: [((1, 2, 3 + src % 2, 8), np.float64)] * 2),
    ("five arrays: float32, int64, float64, of several shapes", 0,
     lambda src: [((3,), np.float32), ((2, 2), np.int64), ((1, 1, 4, 2), np.float64), ((0,), np.float64),
                  ((2, 1, 1 + src, 3), np.float32)]),
    ("large K and V (above MPI's eager limit)", 5, lambda src: [((BIG,), np.float64), ((BIG,), np.float64)]),
    ("one float64 array (B, nh, T, hs), again, with new buffers and other values", 7,
     lambda src: [((2, 3, 5, 4), np.float64)]),
]


def _arrays(src, case, seed):
    """The arrays rank src sends in a case: deterministic, so its right neighbour knows them."""
    _, _, spec = case
    g = np.random.default_rng([seed, src])
    out = []
    for shape, dtype in spec(src):
        a = g.integers(-99, 100, size=shape) if np.dtype(dtype).kind == "i" else g.standard_normal(shape)
        out.append(a.astype(dtype))
    return out


class Call:
    """One call of ring_pass_start on this rank: its inputs, the comm it got, what it returned."""

    def __init__(self, s, case, seed, what):
        n, r = s.size(), s.rank()
        self.case, self.seed, self.what = case, seed, what
        self.left, self.right = (r - 1) % n, (r + 1) % n
        self.send = _arrays(r, case, seed)
        self.before = [a.copy() for a in self.send]
        self.recv = [np.full_like(a, -7) for a in _arrays(self.left, case, seed)]
        self.comm = RingComm(s)
        self.got = None

    def start(self, fn):
        self.got = fn(self.comm, self.send, self.recv, self.case[1])
        problem = self.comm.refused or self.comm.truncated
        if problem:
            raise Misuse(problem)


def _route_problem(call, rank):
    """What is wrong with the messages one call posted, before they are waited for, or None."""
    c, what, tag = call.comm, call.what, call.case[1]
    head = f"rank {rank}, {what}"
    if c.blocking:
        return (f"{head}: ring_pass_start called comm.{c.blocking[0]}, which waits for its partner: start the step "
                "with comm.Isend and comm.Irecv and return the requests unwaited (the caller computes meanwhile)")
    if len(c.isends) != len(call.send) or len(c.irecvs) != len(call.recv):
        return (f"{head}: ring_pass_start posted {len(c.isends)} Isend and {len(c.irecvs)} Irecv for "
                f"{len(call.send)} arrays: one Isend and one Irecv per array")
    for dest, t, buf, _ in c.isends:
        if dest != call.right:
            hint = (" (that is the left neighbour: the ring turned the wrong way)" if dest == call.left
                    else "")
            return (f"{head}: sent to rank {dest}; the ring sends to the right neighbour, (rank + 1) % n = "
                    f"{call.right}{hint}")
        if t != tag:
            return f"{head}: sent with tag {t}; use the tag given, {tag} (two steps may be in flight at once)"
    for source, t, buf, _ in c.irecvs:
        if source != call.left:
            hint = (" (that is the right neighbour: the ring turned the wrong way)" if source == call.right
                    else " (MPI.ANY_SOURCE: receive from the left neighbour only)" if source == MPI.ANY_SOURCE
                    else "")
            return (f"{head}: received from rank {source}; the ring receives from the left neighbour, (rank - 1) % n "
                    f"= {call.left}{hint}")
        if t != tag:
            return f"{head}: received with tag {t}; use the tag given, {tag} (two steps may be in flight at once)"
    sent = sorted(_buffer(b).nbytes for _, _, b, _ in c.isends)
    if sent != sorted(a.nbytes for a in call.send):
        return f"{head}: sent messages of {sent} bytes; the arrays are {[a.nbytes for a in call.send]} bytes"
    into = [_buffer(b) for _, _, b, _ in c.irecvs]
    for i, a in enumerate(call.recv):
        if a.size and not any(_address(b) == _address(a) and b.nbytes == a.nbytes for b in into):
            return (f"{head}: no Irecv receives into recv_arrays[{i}] itself: receive straight into the caller's "
                    "buffers (a buffer of your own, kept or new, is not what the caller reads after its wait)")
    got = call.got
    if not isinstance(got, (list, tuple)) or not all(isinstance(q, MPI.Request) for q in got):
        kind = type(got).__name__ if not isinstance(got, (list, tuple)) else \
            "a list of " + ", ".join(sorted({type(q).__name__ for q in got}))
        return f"{head}: returned {kind}: return the list of the requests Isend and Irecv gave you"
    posted = [q for *_, q in c.isends + c.irecvs]
    missing = [q for q in posted if not any(q is p for p in got)]
    if missing:
        return (f"{head}: returned {len(got)} requests of the {len(posted)} posted: return every Isend and Irecv "
                "request (the caller waits on all of them before it reads recv_arrays or reuses send_arrays)")
    want = []
    for i, (a, b) in enumerate(zip(call.send, call.recv)):
        want.append(_request_for(c.irecvs, b, i))
        want.append(_request_for(c.isends, a, i))
    if len(got) != len(want) or any(q is not w for q, w in zip(got, want)):
        names = {id(q): f"{kind}[{i}]" for kind, arrays, posted in (("recv", call.recv, c.irecvs),
                                                                       ("send", call.send, c.isends))
                 for i, q in ((i, _request_for(posted, a, i)) for i, a in enumerate(arrays))}
        order = ", ".join(names.get(id(q), "?") for q in got)
        return (f"{head}: returned the requests in the order [{order}]; return them as [recv[0], send[0], recv[1], "
                "send[1], ...]: the request of Irecv into recv_arrays[i], then that of Isend of send_arrays[i] "
                "(the ring's backward waits on requests[0::2], the receives, before it adds what arrived, "
                "and on requests[1::2], the sends, only at the end)")
    return None


def _request_for(posted, a, i):
    """The request of the message posted for array a (the i-th array): the one whose buffer is
    a itself, else the i-th posted (a send from a copy of a)."""
    for *_, buf, req in posted:
        b = _buffer(buf)
        if a.size and _address(b) == _address(a) and b.nbytes == a.nbytes:
            return req
    return posted[i][-1]


def _agree(s, problem, pending=()):
    """Every rank learns the lowest rank's finding; all raise it alike (so no rank is left
    waiting, under the grader or without it). Before raising, the messages of `pending`
    calls are taken back: this rank's receives cancelled, what was sent to it dropped."""
    n = s.size()
    mine = np.zeros(NOTE_BYTES, np.uint8)
    if problem:
        raw = problem.encode("utf-8", "replace")[:NOTE_BYTES - 1]
        mine[0] = 1
        mine[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
    table = s.allgather(mine, np.zeros((n, NOTE_BYTES), np.uint8))
    found = [bytes(row[1:]).rstrip(b"\0").decode("utf-8", "replace") for row in table if row[0]]
    if not found:
        return
    if pending:
        _take_back(s, pending)
    raise AssertionError(found[0])


def _take_back(s, calls):
    """Free the messages of calls that will never be matched: cancel this rank's receives,
    drop whatever reaches it, until every rank's sends have completed."""
    sends, recvs = [], []
    for call in calls:
        for *_, req in call.comm.irecvs:
            try:
                req.Cancel()
            except MPI.Exception:
                pass
            recvs.append(req)
        sends += [req for *_, req in call.comm.isends]
    barrier = []

    def done():
        st = MPI.Status()
        while (msg := s.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)) is not None:
            msg.Recv([np.empty(st.Get_count(MPI.BYTE), np.uint8), MPI.BYTE])
        if not barrier and MPI.Request.Testall(sends + recvs):
            barrier.append(s.ref.Ibarrier())
        return bool(barrier) and barrier[0].Test()
    s.wait_for(done, "the check's clean-up of a misrouted ring step")


def _wait(s, call):
    """Wait (stoppably) for a call's requests; a problem in words, or None."""
    reqs = list(call.got)
    try:
        s.wait_for(lambda: MPI.Request.Testall(reqs), f"the check's wait for the requests of {call.what}")
    except MPI.Exception as e:
        return f"rank {s.rank()}, {call.what}: waiting for the requests: {said(e)}"
    return None


def _values_problem(call, rank, other=None):
    """What is wrong with a call's buffers once its requests completed, or None. other: a
    call in flight at the same time, whose data may have landed here."""
    for i, (a, b) in enumerate(zip(call.send, call.before)):
        if not np.array_equal(a, b):
            return f"rank {rank}, {call.what}: ring_pass_start changed send_arrays[{i}]; leave it as it is"
    want = _arrays(call.left, call.case, call.seed)           # the answer, only now
    for i, (got, w) in enumerate(zip(call.recv, want)):
        if not np.array_equal(got, w):
            swapped = [j for j, v in enumerate(want) if v.shape == got.shape and np.array_equal(got, v)]
            theirs = other is not None and any(v.shape == got.shape and np.array_equal(got, v)
                                               for v in _arrays(call.left, other.case, other.seed))
            hint = (f" (that is the left neighbour's send_arrays[{swapped[0]}]: array i goes into "
                    "recv_arrays[i])" if swapped else
                    " (that is what the other exchange in flight sent: a buffer kept between calls, overwritten by "
                    "the next call before its message left? send the caller's arrays themselves)" if theirs else "")
            return (f"rank {rank}, {call.what}: recv_arrays[{i}] holds {_short(got)}, expected rank {call.left}'s "
                    f"send_arrays[{i}], {_short(w)}{hint}")
    return None


def _one_step(fn, s, case, seed, kept):
    r = s.rank()
    call = Call(s, case, seed, f"{case[0]} (tag {case[1]})")
    call.start(fn)
    _agree(s, _route_problem(call, r), [call])
    _agree(s, _wait(s, call), [call])
    _agree(s, _values_problem(call, r))
    for i, a in enumerate(call.recv):
        kept.add(f"{call.what}, recv_arrays[{i}]", a)
    kept.look(call.what)


def _in_turn(fn, s, kept):
    """Two exchanges in flight at once, each with its tag (odd ranks start them in the other
    order), of large arrays, the ranks calling one after another: rank 0 first, then 1, ..,
    each once the rank to its left has returned from both calls. When a rank calls, its
    left neighbour's messages have been sent but its right neighbour has not posted the
    receives: only a function that returns without waiting gets past its call, and data
    that must stay put until the receiver takes it (a large message waits for its
    receive) shows a staging buffer that a second call overwrote."""
    n, r = s.size(), s.rank()
    large = ("large K and V", 0, lambda src: [((BIG,), np.float64), ((BIG // 2 + src,), np.float64)])
    first = Call(s, (large[0], 21, large[2]), 31, "two exchanges in flight at once, the first (tag 21)")
    second = Call(s, (large[0], 22, large[2]), 32, "two exchanges in flight at once, the second (tag 22)")
    token = np.zeros(1, np.int64)
    if r > 0:
        s.recv_probed(s.ref, token, r - 1, TURN_TAG,
                      f"the check's turn: rank {r} calls ring_pass_start once rank {r - 1} has returned from its "
                      f"calls, which it does not when it waits for its messages (post Isend and Irecv, return "
                      "the requests unwaited)")
    for call in ((second, first) if r % 2 else (first, second)):
        call.start(fn)
    if r < n - 1:
        req = s.ref.Isend(token, r + 1, TURN_TAG)
        s.wait_for(req.Test, f"the check's turn, telling rank {r + 1} to call")
    _agree(s, _route_problem(first, r) or _route_problem(second, r), [first, second])
    _agree(s, _wait(s, first) or _wait(s, second), [first, second])
    _agree(s, _values_problem(first, r, second) or _values_problem(second, r, first))
    for call in (first, second):
        for i, a in enumerate(call.recv):
            kept.add(f"{call.what}, recv_arrays[{i}]", a)
    kept.look("two exchanges in flight at once")


def _ring_cases(fn, s):
    kept = Kept("ring_pass_start", s.rank())
    for seed, case in enumerate(CASES):
        _one_step(fn, s, case, seed, kept)
    _in_turn(fn, s, kept)
    problem = kept.found and kept.found + " (the receive buffers are the caller's: keep none of your own)"
    _agree(s, problem)


def check_ring_pass_start(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _ring_cases(fn, s))


# ----------------------------------------------------------------------------- the plug-in check

LESSON = "13_context_parallel"


def _tiny(*extra):
    """Lesson 13 at a tiny size, context parallel over every graded rank: seq 4n+2 does not
    divide into the 2n chunks, so chunks differ in length (the first ones one longer)."""
    return lambda n: ("--cp", str(n), "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq", str(4 * n + 2),
                      "--batch-size", "2", "--attn-block", "2", "--steps", "1", "--timing-reps", "1", *extra)


def _values_match(report):
    """Lesson 13's values verdict: losses, gradients and weights against one process. Its
    bytes verdict counts what the package's ring_pass_start reports to minidist.comm.stats,
    which a student's does not; the unit check holds 13.3 to the messages it posts."""
    return report["max_rel_diff"] <= report["tolerance"]


# 13.1 and 13.2: the lesson's whole verdict (values, every rank's tiles and bytes against
# plan/context.py's counts); 13.1 in float64 and float32 (the merge's arithmetic), 13.2 in
# float64, load-balanced and naive (a layout with the right values but the wrong chunks shows
# in the tiles). 13.3: every message of the ring's forward and backward, in float64 (moving
# bytes does not depend on their dtype; the unit check sends float32 and int64 too).
RING = Run(LESSON, _tiny("--variant", "ring"))
RING64 = Run(LESSON, _tiny("--variant", "ring"), dtypes=("float64",))
NAIVE = Run(LESSON, _tiny("--variant", "ring", "--no-load-balance"), dtypes=("float64",))
RING_VALUES = Run(LESSON, _tiny("--variant", "ring"), dtypes=("float64",), judge=_values_match)

EXERCISES = [
    Exercise("13.1", "merge_partials", attention.merge_partials, check_merge_partials, runs=(RING,)),
    Exercise("13.2", "rank_chunks", context_parallel.rank_chunks, check_rank_chunks, runs=(RING64, NAIVE)),
    Exercise("13.3", "ring_pass_start", context_parallel.ring_pass_start, check_ring_pass_start, MIN_RANKS,
             groups=True, runs=(RING_VALUES,)),
]
