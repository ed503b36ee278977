"""A ring all-reduce that runs in the background while the caller computes.

    h = ring_all_reduce_start(comm, grad_bucket)   # posts the first ring step, returns at once
    ...backward of the next layers, calling h.test() between ops...
    total = h.wait()                               # finish; the same bits as ring_all_reduce

Same algorithm and bytes as the blocking ring (minidist/comm/collectives.py): 2(N-1)
steps, one chunk per step, counted under "all_reduce". But each step is an Isend/Irecv
pair, and `test()` advances the ring as far as it can without waiting: for each step
whose messages have arrived it adds the received chunk (reduce-scatter phase), then
posts the next step. MPI only moves data while a process is inside an MPI call, so the
caller must call test() now and then (DDP's overlap, lesson 02) or wait() at the end.

Several all-reduces may be in flight at once. Each takes its own tag (20000 + a
counter kept per communicator, which its ranks advance in the same order: start them
in the same order on every rank of that communicator, as DDP's buckets are), so the
messages of different handles never mix;
a ring step's two messages from one neighbour arrive in order within one tag.

Do not change x, nor read the result, before test() returned True or wait() returned.
The check of shapes and dtypes (one small message, under "check") is MPI's own
non-blocking Iallgather, finished on the first test() or wait().

A device x (minidist/comm/staging.py): on the staged path it comes to the host at the
start and the result goes back to the device once, when wait() (or `result`) first gives
it; on the direct path the ring runs on device buffers.
"""
import itertools
import time

from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.checks import MismatchError, finish_avg, post, reduce_ufunc, refuse, verify, wire
from minidist.comm.collectives import _flat, chunk_bounds
from minidist.comm.staging import arrive, asarray, namespace
from minidist.comm.watchdog import waiting

TAG_BASE, TAG_SPAN = 20000, 10000
_TAGS = MPI.Comm.Create_keyval()   # one counter per communicator: its ranks start its all-reduces in one order


def _counter(comm):
    """The communicator's tag counter, kept as an MPI attribute of the communicator: it
    goes when the communicator is freed. (Keyed by comm.py2f(), a freed communicator's
    counter would pass to the next one MPI gives the same handle, and ranks whose
    histories differ would then disagree on tags and deadlock.)"""
    counter = comm.Get_attr(_TAGS)
    if counter is None:
        counter = itertools.count()
        comm.Set_attr(_TAGS, counter)
    return counter


class RingAllReduce:
    """The state of one ring all-reduce in flight: which step, which messages posted."""
    name = "all_reduce"                           # what stats counts it under

    def __init__(self, comm, x, op="sum", tag=None, check=True):
        self.t_start, self.t_end = time.perf_counter(), None
        self.comm, self.op = comm, op
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        if tag is None:
            counter = _counter(comm)
            tag = TAG_BASE + next(counter) % TAG_SPAN
        self.tag = tag
        x, self._back = arrive(x)             # a device x: to the host, or as it is (direct)
        x = asarray(x)
        self.shape = x.shape
        self.src = _flat(x)
        self.xp = namespace(self.src)
        self.out = self.xp.empty_like(self.src)
        self._given = None                    # the result, in x's kind, once asked for
        self.bounds = chunk_bounds(self.src.size, self.size)
        self.step, self.n_steps = 0, self.steps_in(self.size)
        self.requests = []                        # the Isend/Irecv of the step in flight
        self.recv_c = None
        stats.add(self.name, calls=1)
        self._check, self._error = None, None
        if check:                                 # shapes and dtypes: MPI's own Iallgather
            mine, table = post(comm, x, op, name="ring_all_reduce_start")
            self._check = (comm.Iallgather(mine, table), mine, table)
        else:
            refuse(comm, x, "ring_all_reduce_start", op=op)
        if self.size == 1:
            self.out[:] = self.src
        if self._check is None or self._finish_check(wait=False):
            if self._error is None:
                self.test()                       # post the first step right away

    @staticmethod
    def steps_in(n):
        """Ring steps of the whole all-reduce: N-1 reduce-scatter, N-1 all-gather."""
        return 2 * (n - 1)

    def _chunk(self, a, c):
        return a[self.bounds[c]:self.bounds[c + 1]]

    def _post_step(self):
        """Post the Irecv and Isend of the current step."""
        r, s, n = self.rank, self.step, self.size
        if s < n - 1:   # reduce-scatter: send chunk r-s-1, receive chunk r-s-2 to add mine to
            send_c, self.recv_c = (r - s - 1) % n, (r - s - 2) % n
            sendbuf = self._chunk(self.src if s == 0 else self.out, send_c)
        else:           # all-gather: forward chunk r-t, receive chunk r-t-1 into its place
            t = s - (n - 1)
            send_c, self.recv_c = (r - t) % n, (r - t - 1) % n
            sendbuf = self._chunk(self.out, send_c)
        recvbuf = self._chunk(self.out, self.recv_c)
        self.requests = [self.comm.Irecv(wire(recvbuf), (r - 1) % n, self.tag),
                         self.comm.Isend(wire(sendbuf), (r + 1) % n, self.tag)]
        stats.add(self.name, sent=sendbuf.nbytes, recv=recvbuf.nbytes, messages=1)

    def _finish_step(self):
        """The step's messages are done: add my piece to the received partial sum."""
        self.requests = []
        if self.step < self.size - 1:
            recvbuf = self._chunk(self.out, self.recv_c)
            reduce_ufunc(self.op, self.xp)(recvbuf, self._chunk(self.src, self.recv_c), out=recvbuf)
        self.step += 1

    def _finish_check(self, wait):
        request, _, table = self._check
        if not (request.Wait() if wait else request.Test()):
            return False
        self._check = None
        try:
            verify(table, "ring_all_reduce_start", True, ())
        except MismatchError as e:     # raised by test() or wait(), never by the start
            self._error = e
        return True

    def _complete(self):
        if self.t_end is None:
            if self.op == "avg":
                finish_avg(self.out, self.size)
            self.t_end = time.perf_counter()

    @property
    def done(self):
        return self.t_end is not None

    def test(self):
        """Advance as far as possible without blocking; True when the result is ready."""
        if self.done:
            return True
        if self._check is not None and not self._finish_check(wait=False):
            return False
        if self._error is not None:
            raise self._error
        while self.step < self.n_steps:
            if not self.requests:
                self._post_step()
            if not MPI.Request.Testall(self.requests):
                return False                      # the neighbours are not there yet
            self._finish_step()
        self._complete()
        return True

    def wait(self):
        """Finish (blocking) and return the reduced array, shaped like x."""
        with waiting("ring_all_reduce_start(...).wait()"):
            if self._check is not None:
                self._finish_check(wait=True)
            if self._error is not None:
                raise self._error
            while self.step < self.n_steps:
                if not self.requests:
                    self._post_step()
                MPI.Request.Waitall(self.requests)
                self._finish_step()
            self._complete()
        return self.result

    def _give(self, host):
        """The result in the kind x came in: on the staged path copied to the device once."""
        if self._given is None:
            self._given = self._back(host)
        return self._given

    @property
    def result(self):
        if not self.done:
            raise RuntimeError("the all-reduce is still in flight: call wait() first")
        return self._give(self.out.reshape(self.shape))


def ring_all_reduce_start(comm, x, op="sum", tag=None, check=True):
    """Start a non-blocking ring all-reduce of x; returns a RingAllReduce handle."""
    return RingAllReduce(comm, x, op, tag, check)


class RingReduceScatter(RingAllReduce):
    """The ring all-reduce's first phase alone, in the background (ZeRO-2's overlap):
    N-1 steps; the result is chunk `rank` of numpy.array_split(sum, N), counted as
    "reduce_scatter"."""
    name = "reduce_scatter"

    @staticmethod
    def steps_in(n):
        """The first phase only. (Known before the first test() in __init__: set after it,
        a partner already waiting let that test() run on into all-gather steps, sending
        bytes the reduce-scatter does not send, seen under Open MPI.)"""
        return n - 1

    def __init__(self, comm, x, op="sum", tag=None, check=True):
        super().__init__(comm, x, op, tag, check)
        if self.size == 1:
            self._complete()

    @property
    def result(self):
        if not self.done:
            raise RuntimeError("the reduce-scatter is still in flight: call wait() first")
        return self._give(self._chunk(self.out, self.rank))


class RingAllGather(RingAllReduce):
    """The ring all-reduce's second phase alone, in the background (FSDP's prefetch):
    rank r brings chunk r of numpy.array_split(full, N) of a length-n array, and every
    rank ends with the full array, counted as "all_gather". The chunks' lengths differ
    by design, so the check is this rank's own (its chunk must be chunk r's length)."""
    name = "all_gather"

    def __init__(self, comm, chunk, n, tag=None):
        self.t_start, self.t_end = time.perf_counter(), None
        self.comm, self.op = comm, "sum"
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        if tag is None:
            counter = _counter(comm)
            tag = TAG_BASE + next(counter) % TAG_SPAN
        self.tag = tag
        chunk, self._back = arrive(chunk)
        chunk = asarray(chunk).reshape(-1)
        refuse(comm, chunk, "ring_all_gather_start", op="sum")
        self.bounds = chunk_bounds(n, self.size)
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        if hi - lo != chunk.size:
            raise ValueError(f"rank {self.rank} brings {chunk.size} values; chunk {self.rank} of "
                             f"{n} has {hi - lo}")
        self.shape = (n,)
        self.xp, self._given = namespace(chunk), None
        self.src = self.out = self.xp.empty(n, chunk.dtype)
        self.out[lo:hi] = chunk                   # my own piece, in its place
        self.step, self.n_steps = self.size - 1, 2 * (self.size - 1)   # phase two only
        self.requests, self.recv_c = [], None
        stats.add(self.name, calls=1)
        self._check, self._error = None, None
        self.test()                               # post the first step right away


def ring_reduce_scatter_start(comm, x, op="sum", tag=None, check=True):
    """Start a non-blocking ring reduce-scatter of x (flat); wait() returns this rank's chunk."""
    return RingReduceScatter(comm, asarray(x).reshape(-1), op, tag, check)


def ring_all_gather_start(comm, chunk, n, tag=None):
    """Start a non-blocking ring all-gather of flat chunks into a length-n array."""
    return RingAllGather(comm, chunk, n, tag)
