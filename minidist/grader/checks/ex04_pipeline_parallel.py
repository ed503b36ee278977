"""Checks for lessons/exercises/04_pipeline_parallel.py: two schedules and one exchange.

The schedules are graded by minidist.parallel.schedules, the referee: validate (every
action once, a backward after its forward, no rank waiting for ever), then the
simulator, whose bubble must equal the formula exactly and whose peak live activations
must be GPipe's m or 1F1B's min(p - r, m) on rank r, for p up to 8 and m up to 16. A
1F1B whose warm-up is off by one is still a valid order: its memory or its bubble gives
it away.

Any order of GPipe's backwards is accepted (0..m-1 as the stub says, or m-1..0 as the
last stage's reversed pass): each is valid, has GPipe's bubble and holds m micro-batches.

exchange runs on every rank with a CountingComm whose Send waits for its Recv, as MPI
allows any Send to, and which refuses a message to or from another rank or tag than the
call's send and recv name. Four calls: one with nothing to do (None, None); a line
0 -> 1 -> ... -> n-1 in float64, where the first stage only sends and the last only
receives; then twice a ring in float32, every rank sending to r+1 and receiving from r-1
at once (as neighbouring stages do in 1F1B's steady state), with the sender's rank in the
tag, so that the receive's source and tag differ from the send's dest and tag. Two
blocking sends facing each other never finish (a time-out). The received array must
have recv's shape, dtype and the sender's values, and must not change on a later call.
"""
import numpy as np
from mpi4py import MPI

from minidist.grader.checks import Exercise, own_session
from minidist.grader.counting import CountingComm, Misuse
from minidist.grader.referee import said, where
from minidist.parallel import pipeline_parallel, schedules

SHAPE = (2, 3, 4)
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
            f = schedules.formula("gpipe" if name == "gpipe" else "1f1b", p, m)
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


class _ExchangeComm(CountingComm):
    """A CountingComm that knows the one exchange asked for: a message to another rank or
    tag than send's, or a receive from another rank or tag than recv's, is refused at once
    (as a Misuse), instead of waiting for a message that never comes."""

    def __init__(self, session, send, recv):
        super().__init__(session, REFUSE)
        self._send, self._recv = send, recv

    def _sending(self, dest, tag):
        rank = self.Get_rank()
        if self._send is None:
            self.refused = (f"rank {rank}: exchange(comm, send=None, {_spec_words(self._recv, 'recv')}) sent a "
                            f"message to rank {dest}: with send=None this stage has nothing to send")
        elif (dest, tag) != tuple(self._send[1:]):
            self.refused = (f"rank {rank}: sent to rank {dest} with tag {tag}; {_spec_words(self._send, 'send')} "
                            f"asks for rank {self._send[1]} with tag {self._send[2]}")
        if self.refused:
            raise Misuse(self.refused)

    def _receiving(self, source, tag):
        rank = self.Get_rank()
        if self._recv is None:
            self.refused = (f"rank {rank}: exchange(comm, {_spec_words(self._send, 'send')}, recv=None) posted a "
                            f"receive from {_peer(source, MPI.ANY_SOURCE, 'source')}: with recv=None this stage "
                            "receives nothing")
        elif (source, tag) != tuple(self._recv[2:]):
            self.refused = (f"rank {rank}: posted its receive from {_peer(source, MPI.ANY_SOURCE, 'source')} "
                            f"with {_peer(tag, MPI.ANY_TAG, 'tag')}; {_spec_words(self._recv, 'recv')} asks for "
                            f"rank {self._recv[2]} with tag {self._recv[3]} (receive with recv's own source and "
                            "tag: they are not send's dest and tag)")
        if self.refused:
            raise Misuse(self.refused)

    def Send(self, buf, dest, tag=0):
        self._sending(dest, tag)
        super().Send(buf, dest, tag)

    def Ssend(self, buf, dest, tag=0):
        self._sending(dest, tag)
        super().Ssend(buf, dest, tag)

    def Isend(self, buf, dest, tag=0):
        self._sending(dest, tag)
        return super().Isend(buf, dest, tag)

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        self._receiving(source, tag)
        super().Recv(buf, source, tag, status)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self._receiving(source, tag)
        return super().Irecv(buf, source, tag)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None):
        self._sending(dest, sendtag)
        self._receiving(source, recvtag)
        super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)


def _data(rank, what, dtype):
    return np.random.default_rng([40, rank, what]).standard_normal(SHAPE).astype(dtype)


def _one(fn, s, role, send, recv, what):
    """One call of exchange on this rank: the received array (checked), after the send completed."""
    rank = s.rank()
    comm = _ExchangeComm(s, send, recv)
    before = None if send is None else send[0].copy()
    call = f"exchange(comm, {_spec_words(send, 'send')}, {_spec_words(recv, 'recv')})"
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
    if req is not None:
        s.wait_for(req.Test, f"the send's request to rank {send[1] if send else '?'}")
    if recv is None:
        if got is not None:
            raise AssertionError(f"rank {rank}: {call}, {role}, returned {type(got).__name__} as the received "
                                 "array; with recv=None it is None")
    else:
        src, dtype = recv[2], np.dtype(recv[1])
        theirs = _data(src, what, dtype)
        if got is None or np.shape(got) != SHAPE:
            raise AssertionError(f"rank {rank}: {call}, {role}, received {None if got is None else np.shape(got)} "
                                 f"from rank {src}, not the {SHAPE} array rank {src} sent")
        if np.asarray(got).dtype != dtype:
            raise AssertionError(f"rank {rank}: {call} returned a {np.asarray(got).dtype} array; recv asks for "
                                 f"{dtype} (receive into np.empty(shape, dtype): the bytes of {SHAPE} {dtype} "
                                 "values read as another dtype are other numbers)")
        if not np.array_equal(got, theirs):
            raise AssertionError(f"rank {rank}: {call}, {role}, received other values from rank {src}, not the "
                                 f"{SHAPE} array rank {src} sent (did you wait for the receive before returning?)")
    if send is not None:
        if not np.array_equal(send[0], before):
            raise AssertionError(f"rank {rank}: the array to send was changed")
        if comm.bytes_sent != send[0].nbytes:
            raise AssertionError(f"rank {rank}: {call} sent {comm.bytes_sent} bytes; one {SHAPE} "
                                 f"{send[0].dtype} array is {send[0].nbytes}")
    elif comm.bytes_sent:
        raise AssertionError(f"rank {rank}: {call} sent {comm.bytes_sent} bytes; with send=None it sends nothing")
    return got


def check_exchange(fn, session=None):
    with own_session(session) as s:
        rank, n = s.rank(), s.size()
        # nothing to do: a stage between two actions that need nothing
        _one(fn, s, "with nothing to send or receive", None, None, 0)
        # a line 0 -> 1 -> ... -> n-1: the first stage only sends, the last only receives
        send = (_data(rank, 1, np.float64), rank + 1, 10 + rank) if rank < n - 1 else None
        recv = (SHAPE, np.float64, rank - 1, 10 + rank - 1) if rank > 0 else None
        role = ("the only stage of a line" if n == 1 else "the first stage of a line (it only sends)" if rank == 0
                else "the last stage of a line (it only receives)" if rank == n - 1
                else "a middle stage of a line (it receives and sends)")
        _one(fn, s, role, send, recv, 1)
        # a ring in float32, everyone at once: each sends to r+1 and receives from r-1, tags differ
        right, left = (rank + 1) % n, (rank - 1) % n
        first = None
        for what in (2, 3):                # twice: a buffer reused across calls changes the first result
            send = (_data(rank, what, np.float32), right, 100 * what + rank)
            recv = (SHAPE, np.float32, left, 100 * what + left)
            got = _one(fn, s, "in a ring (sending to the right, receiving from the left at once)", send, recv, what)
            first = got if first is None else first
        if not np.array_equal(first, _data(left, 2, np.float32)):
            raise AssertionError(f"rank {rank}: the array the first ring exchange returned changed during the "
                                 "second: receive into a new array on every call")


EXERCISES = [
    Exercise("4.1", "gpipe", schedules.gpipe, check_gpipe),
    Exercise("4.2", "one_f_one_b", schedules.one_f_one_b, check_one_f_one_b),
    Exercise("4.3", "exchange", pipeline_parallel.exchange, check_exchange, 3),
]
