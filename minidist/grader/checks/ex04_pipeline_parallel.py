"""Checks for lessons/exercises/04_pipeline_parallel.py: two schedules and one exchange.

The schedules are graded by minidist.parallel.schedules, the referee: validate (every
action once, a backward after its forward, no rank waiting for ever), then the
simulator, whose bubble must equal the formula exactly and whose peak live activations
must be GPipe's m or 1F1B's min(p - r, m) on rank r, for p up to 8 and m up to 16. A
1F1B whose warm-up is off by one is still a valid order: its memory or its bubble gives
it away.

Any order of GPipe's backwards is accepted (0..m-1 as the stub says, or m-1..0 as the
last stage's reversed pass): each is valid, has GPipe's bubble and holds m micro-batches.

exchange runs on every rank with a CountingComm whose Send and Isend complete only when
the matching receive is posted (as MPI's do past the eager limit, a few KB), and which
refuses a message to or from another rank or tag than the call's send and recv name.
Every rank makes seven calls, as the pipeline executor makes them, each message a
(7, 67, 71) array (266 KB in float64, 133 KB in float32: past MPI's eager limit):
  - nothing to do (None, None);
  - a line 0 -> 1 -> ... -> n-1 forward (activations to the next stage) in float64, then
    backward (gradients to the previous stage) in float32: the first stage of each only
    sends, the last only receives, the middle ones do both;
  - neighbours facing each other, pairs (0, 1), (2, 3), ... in float64, then (1, 2),
    (3, 4), ... in float32: each sends to the other and receives from it at once, as two
    stages do in 1F1B's steady state (one sends activations forward, the other gradients
    back). Two blocking sends facing each other never finish (a time-out); a Wait on the
    Isend's request before the receive is posted is refused at once, wherever it happens;
  - a ring forward in float32, then backward in float64 (the interleaved schedule's last
    stage sends to rank 0's next chunk, and rank 0's gradients go back to it).
The sender's rank is in every tag, so a receive's source and tag differ from the send's
dest and tag. Each call must return the sender's values in recv's shape and dtype, its
receive complete, and the send's request (None without a send: the executor waits for
and counts the sends it is handed); after every call each array returned before must
still hold what it received (a buffer reused per shape and dtype is overwritten by a
later call). Expected values are computed only after the student's function returned.

The plug-in check then runs lesson 04 on the graded ranks with the student's function:
4.1 under --schedule gpipe, 4.2 under 1f1b, 4.3 under 1f1b with activations of 256 KB in
float64 (128 KB in float32).
"""
import numpy as np
from mpi4py import MPI

from minidist.grader.checks import Exercise, own_session
from minidist.grader.counting import CountingComm, Misuse
from minidist.grader.plugin import Run
from minidist.grader.referee import said, where
from minidist.parallel import pipeline_parallel, schedules
from minidist.plan.pipeline import bubble_fraction

SHAPE = (7, 67, 71)       # 33,299 values: 266 KB in float64, 133 KB in float32
BOTH_WAYS = "activations go forward to the next stage, gradients back to the previous one"
REFUSE = "use Irecv/Isend (or Send/Recv) between two stages: this exercise builds the exchange itself"


def _check_schedule(fn, name, peak):
    for p in range(1, 9):
        for m in range(1, 17):
            sch = fn(p, m)
            try:
                schedules.validate(sch, p, m)
            except schedules.ScheduleError as e:
                raise AssertionError(f"{name}({p}, {m}): {e}")
            sim = schedules.simulate(sch, p, m)
            want = [peak(p, m, r) for r in range(p)]
            if sim.peak != want:
                r = next(r for r in range(p) if sim.peak[r] != want[r])
                raise AssertionError(f"{name}({p}, {m}): rank {r} holds {sim.peak[r]} micro-batches' activations at "
                                     f"once, {name} holds {want[r]} (check the warm-up: rank r runs p-r-1 forwards "
                                     "before its first backward)" if name == "one_f_one_b" else
                                     f"{name}({p}, {m}): rank {r} holds {sim.peak[r]} micro-batches' activations at "
                                     f"once, expected {want[r]}")
            f = bubble_fraction("gpipe" if name == "gpipe" else "1f1b", p, m)
            if sim.bubble != f:
                raise AssertionError(f"{name}({p}, {m}): the simulated bubble is {sim.bubble} of the time, the "
                                     f"formula (p-1)/(m+p-1) gives {f}")


def check_gpipe(fn):
    _check_schedule(fn, "gpipe", lambda p, m, r: m)


def check_one_f_one_b(fn):
    _check_schedule(fn, "one_f_one_b", lambda p, m, r: min(p - r, m))


def _spec_words(spec, kind):
    if spec is None:
        return f"{kind}=None"
    if kind == "send":
        return f"send=(array, dest={spec[1]}, tag={spec[2]})"
    return f"recv=({spec[0]}, {np.dtype(spec[1]).name}, source={spec[2]}, tag={spec[3]})"


def _peer(value, any_value, what):
    if value == any_value:
        return f"any {what} (MPI.ANY_{what.upper()})"
    return f"rank {value}" if what == "source" else f"tag {value}"


class _SendRequest(MPI.Request):
    """The request the student's Isend gets: a real mpi4py request (Waitall, Test work), whose
    Wait is refused while the call's receive is not yet posted."""

    def Wait(self, status=None):
        self._comm._waiting_for_send(self._dest)
        return super().Wait(status)

    def wait(self, status=None):
        self._comm._waiting_for_send(self._dest)
        return super().wait(status)


class _ExchangeComm(CountingComm):
    """A CountingComm that knows the one exchange asked for: a message to another rank or
    tag than send's, a receive from another rank or tag than recv's, or a wait for the
    send before the receive is posted, is refused at once (as a Misuse) instead of waiting
    for a message that never comes."""

    def __init__(self, session, send, recv):
        super().__init__(session, REFUSE)
        self._send, self._recv = send, recv
        self.posted = False                 # the receive recv asks for is posted
        self.recv_requests = []             # the Irecv requests handed out: complete when exchange returns

    def _sending(self, dest, tag):
        rank = self.Get_rank()
        if self._send is None:
            self.refused = (f"rank {rank}: exchange(comm, send=None, {_spec_words(self._recv, 'recv')}) sent a "
                            f"message to rank {dest}: with send=None this stage has nothing to send")
        elif (dest, tag) != tuple(self._send[1:]):
            want = self._send[1]
            hint = f" (send to send's dest, the {self._side(want)} stage here: {BOTH_WAYS})" if dest != want else ""
            self.refused = (f"rank {rank}: sent to rank {dest} with tag {tag}; {_spec_words(self._send, 'send')} "
                            f"asks for rank {want} with tag {self._send[2]}{hint}")
        if self.refused:
            raise Misuse(self.refused)

    def _receiving(self, source, tag):
        rank = self.Get_rank()
        if self._recv is None:
            self.refused = (f"rank {rank}: exchange(comm, {_spec_words(self._send, 'send')}, recv=None) posted a "
                            f"receive from {_peer(source, MPI.ANY_SOURCE, 'source')}: with recv=None this stage "
                            "receives nothing")
        elif (source, tag) != tuple(self._recv[2:]):
            want = self._recv[2]
            if self._send is not None and (source, tag) == tuple(self._send[1:]):
                hint = "receive with recv's own source and tag: they are not send's dest and tag"
            elif source != want and source != MPI.ANY_SOURCE:
                hint = f"receive from recv's source, the {self._side(want)} stage here: {BOTH_WAYS}"
            else:
                hint = "receive with recv's own source and tag"
            self.refused = (f"rank {rank}: posted its receive from {_peer(source, MPI.ANY_SOURCE, 'source')} "
                            f"with {_peer(tag, MPI.ANY_TAG, 'tag')}; {_spec_words(self._recv, 'recv')} asks for "
                            f"rank {want} with tag {self._recv[3]} ({hint})")
        if self.refused:
            raise Misuse(self.refused)
        self.posted = True

    def _side(self, peer):
        """'next' or 'previous': where `peer` is from this rank (a ring wraps around)."""
        return "next" if peer == (self.Get_rank() + 1) % self.Get_size() else "previous"

    def _waiting_for_send(self, dest):
        if self._recv is not None and not self.posted and not self.refused:
            self.refused = (f"rank {self.Get_rank()}: waited for its Isend to rank {dest} before posting its receive "
                            f"from rank {self._recv[2]}: two neighbours exchanging towards each other (1F1B) would "
                            "each wait for the other's receive for ever. Post the receive first, wait for it "
                            "only, and return the send's request: the caller waits for it later")
            raise Misuse(self.refused)

    def Send(self, buf, dest, tag=0):
        self._sending(dest, tag)
        super().Send(buf, dest, tag)

    def Ssend(self, buf, dest, tag=0):
        self._sending(dest, tag)
        super().Ssend(buf, dest, tag)

    def Isend(self, buf, dest, tag=0):
        self._sending(dest, tag)
        req = _SendRequest(super().Isend(buf, dest, tag))
        req._comm, req._dest = self, dest
        return req

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        self._receiving(source, tag)
        super().Recv(buf, source, tag, status)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self._receiving(source, tag)
        req = super().Irecv(buf, source, tag)
        self.recv_requests.append(req)
        return req

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None):
        self._sending(dest, sendtag)
        self._receiving(source, recvtag)
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


F64, F32 = np.dtype(np.float64), np.dtype(np.float32)


def _plan(rank, n):
    """This rank's calls, in order: (words, dest or None, source or None, dtype). Every rank
    makes the same number of calls; call k's messages carry tag 100 k + the sender's rank."""
    nxt, prv = (rank + 1 if rank + 1 < n else None), (rank - 1 if rank > 0 else None)
    first = rank ^ 1 if rank ^ 1 < n else None                       # pairs (0, 1), (2, 3), ...
    second = rank + 1 if rank % 2 else rank - 1                      # pairs (1, 2), (3, 4), ...
    second = second if 0 <= second < n else None
    return [("with nothing to send or receive", None, None, F64),
            ("in a line forward", nxt, prv, F64),
            ("in a line backward", prv, nxt, F32),
            ("facing a neighbour (1F1B)", first, first, F64),
            ("facing its other neighbour (1F1B)", second, second, F32),
            ("in a ring forward", (rank + 1) % n, (rank - 1) % n, F32),
            ("in a ring backward", (rank - 1) % n, (rank + 1) % n, F64)]


def _data(rank, k, dtype):
    return np.random.default_rng([40, rank, k]).standard_normal(SHAPE).astype(dtype)


def _role(words, send, recv):
    does = ("sends and receives" if send and recv else "only sends" if send else "only receives" if recv
            else "nothing to do")
    return words if not (send or recv) else f"{words}, this stage {does}"


def _one(fn, s, k, words, dest, source, dtype, later):
    """Call k of exchange on this rank, checked; returns the received array (or None). A fault
    that would not stop the next calls is added to `later`, to be said after them."""
    rank = s.rank()
    send = None if dest is None else (_data(rank, k, dtype), dest, 100 * k + rank)
    recv = None if source is None else (SHAPE, dtype, source, 100 * k + source)
    comm = _ExchangeComm(s, send, recv)
    before = None if send is None else send[0].copy()
    call = f"exchange(comm, {_spec_words(send, 'send')}, {_spec_words(recv, 'recv')})"
    role = _role(words, send, recv)
    try:
        result = fn(comm, send, recv)
    except (AssertionError, NotImplementedError):     # a wrong call (Misuse), or an untouched stub: TODO
        raise
    except Exception as e:
        raise AssertionError(f"rank {rank}: {call}, {role}, raised {said(e)}{where(e)}: either of send and recv "
                             "may be None (the first stage only sends, the last only receives)") from None
    if comm.refused:
        raise AssertionError(comm.refused)
    if not isinstance(result, tuple) or len(result) != 2:
        raise AssertionError(f"rank {rank}: {call} returned {type(result).__name__}; "
                             "return (the received array or None, the send's request or None)")
    got, req = result
    if any(r != MPI.REQUEST_NULL for r in comm.recv_requests):
        raise AssertionError(f"rank {rank}: {call}, {role}, returned before its receive from rank {source} "
                             "completed: wait for the receive (req.Wait()) before returning the array, which the "
                             "caller uses at once; only the send's request is left to the caller")
    if (send is None) != (req is None) and not later:      # said after every call: a deadlock comes first
        later.append(f"rank {rank}: {call}, {role}, returned None as the send's request: return the Isend's "
                     "request (the caller waits for it later, and counts the bytes it sent)" if send is not None else
                     f"rank {rank}: {call}, {role}, returned a request with send=None: return None (the caller "
                     "takes a request for a send of its own, to wait for and count)")
    if req is not None and hasattr(req, "Test"):
        s.wait_for(req.Test, f"the send's request to rank {dest}")
    if recv is None:
        if got is not None:
            raise AssertionError(f"rank {rank}: {call}, {role}, returned {type(got).__name__} as the received "
                                 "array; with recv=None it is None")
    else:
        if got is None or np.shape(got) != SHAPE:
            raise AssertionError(f"rank {rank}: {call}, {role}, received {None if got is None else np.shape(got)} "
                                 f"from rank {source}, not the {SHAPE} array rank {source} sent")
        if np.asarray(got).dtype != dtype:
            raise AssertionError(f"rank {rank}: {call} returned a {np.asarray(got).dtype} array; recv asks for "
                                 f"{dtype} (receive into np.empty(shape, dtype): the bytes of {dtype} values read "
                                 "as another dtype are other numbers)")
        if not np.array_equal(got, _data(source, k, dtype)):     # computed now, after the call returned
            raise AssertionError(f"rank {rank}: {call}, {role}, received other values from rank {source}, not the "
                                 f"{SHAPE} array rank {source} sent")
    if send is not None:
        if not np.array_equal(send[0], before):
            raise AssertionError(f"rank {rank}: {call} changed the array to send")
        if comm.bytes_sent != send[0].nbytes:
            raise AssertionError(f"rank {rank}: {call} sent {comm.bytes_sent} bytes; one {SHAPE} "
                                 f"{send[0].dtype} array is {send[0].nbytes}")
    elif comm.bytes_sent:
        raise AssertionError(f"rank {rank}: {call} sent {comm.bytes_sent} bytes; with send=None it sends nothing")
    return got


def check_exchange(fn, session=None):
    with own_session(session) as s:
        rank, n = s.rank(), s.size()
        kept, later = [], []                          # (call, the array returned, a copy of it then); faults
        for k, (words, dest, source, dtype) in enumerate(_plan(rank, n)):
            got = _one(fn, s, k, words, dest, source, dtype, later)
            for j, old, copy in kept:
                if not np.array_equal(old, copy):
                    raise AssertionError(f"rank {rank}: the array that exchange call {j} returned (from rank "
                                         f"{_plan(rank, n)[j][2]}) changed during call {k}, {words}: receive into a "
                                         "new array on every call (the caller still uses the earlier ones)")
            if got is not None:
                kept.append((k, got, np.array(got, copy=True)))
        if later:
            raise AssertionError(later[0])


def lesson_04(schedule, layers, embd, block, rows, m, steps):
    """A Run of lesson 04 on n stages; layers and m are functions of n (the graded world size)."""
    def argv(n):
        return ("--schedule", schedule, "--n-layer", str(layers(n)), "--n-head", "2", "--n-embd", str(embd),
                "--block-size", str(block), "--batch-size", str(rows * m(n)), "--micro-batches", str(m(n)),
                "--steps", str(steps))
    return Run("04_pipeline_parallel", argv)


# the schedules: one layer per stage, 4 micro-batches of one sequence (GPipe holds 4, 1F1B min(p - r, 4))
RUNS_GPIPE = (lesson_04("gpipe", lambda n: n, 16, 8, 1, lambda n: 4, steps=1),)
RUNS_1F1B = (lesson_04("1f1b", lambda n: n, 16, 8, 1, lambda n: 4, steps=1),)
# the exchange: 1F1B on n stages (a line both ways; at the turn from forwards to backwards every
# two neighbours face each other, one sending activations forward, the other gradients back) with
# m = 2 micro-batches of b s h = 64 x 16 x 32 values: 256 KB in float64, 128 KB in float32, past
# MPI's eager limit (a few KB), so an exchange that waits where the package's does not deadlocks here
# as it would at scale. (The interleaved schedule's ring is left to the unit check: its cost grows
# as n squared, n micro-batches through 2n layers.)
RUNS_EXCHANGE = (lesson_04("1f1b", lambda n: n, 32, 16, 64, lambda n: 2, steps=1),)

EXERCISES = [
    Exercise("4.1", "gpipe", schedules.gpipe, check_gpipe, runs=RUNS_GPIPE),
    Exercise("4.2", "one_f_one_b", schedules.one_f_one_b, check_one_f_one_b, runs=RUNS_1F1B),
    Exercise("4.3", "exchange", pipeline_parallel.exchange, check_exchange, 3,
             why_ranks=("at 2 ranks a pipeline has no middle stage (one that receives and sends in one call), and "
                        "the next stage is also the previous one, so a message sent the wrong way would pass;"),
             runs=RUNS_EXCHANGE),
]
