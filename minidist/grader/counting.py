"""The communicator a check hands to the student's function: it counts, refuses, and can be stopped.

Why not hand over COMM_WORLD itself:
  * the check must know what travelled: bytes and messages this rank sent, so that a ring
    with one step too many (M instead of (N-1)/N M) fails although its result is right;
  * an exercise that builds a collective must not call one: `comm.Allreduce` is refused
    ("use Send/Recv/Sendrecv: this exercise builds the collective itself");
  * a rank blocked in a receive that will never come must be freed when another rank
    fails or time runs out, so that the grader can go on and MPI can finish normally.

So `CountingComm` forwards MPI's point-to-point buffer methods (Send, Recv, Sendrecv,
Isend, Irecv, Iprobe, Get_rank, Get_size) to a private duplicate of COMM_WORLD. Its
blocking methods never block inside MPI: they post the non-blocking call and poll it,
checking the session's stop flag between polls, and they note what they wait for
("Recv from rank 2 at step 1") so a time-out can say where each rank was stuck. A
receive probes first (Improbe), so a message longer than its buffer is caught before
MPI's "Message truncated" and explained in the ring's terms. Requests from Isend and
Irecv are real mpi4py requests: `MPI.Request.Waitall(requests)` works. To free a rank
stuck in such a wait, the grader cancels the rank's own receives (`Session.stop`) and
every rank receives and drops whatever was sent to it (`Session.drain`), which
completes the sends that waited for a partner.

One exception to the refusal: the package's own shape check (minidist.comm.checks, a
128-byte descriptor per rank, which the package's answers and exercise 02's calls to
ring_all_reduce make) may call Allgather. It runs point-to-point on a second duplicate,
also stoppable, and is counted apart from the data (`check_bytes`).

A `Session` is made on every rank at once, in the main thread (it duplicates
COMM_WORLD, a collective), before the check's thread starts.
"""
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

POLL_S = 0.0002           # between two polls of a pending message: short, but lets other ranks run
REFEREE_TAG = 31000        # the check's own messages, on the session's second duplicate
COLLECTIVES = {"Allreduce", "Allgather", "Allgatherv", "Alltoall", "Alltoallv", "Alltoallw", "Bcast",
               "Reduce", "Reduce_scatter", "Reduce_scatter_block", "Scatter", "Scatterv", "Gather",
               "Gatherv", "Scan", "Exscan", "Barrier", "Dup", "Split", "Create", "Neighbor_allgather"}
COLLECTIVES |= {"I" + name[0].lower() + name[1:] for name in COLLECTIVES}   # Iallreduce, Ibarrier, ...


class Misuse(AssertionError):
    """The student's use of the communicator is itself wrong: a refused call, or a message
    longer than the buffer that receives it. That is the cause; whatever the other ranks
    then compute from it is a consequence, so the grader reports this one first."""


class Stopped(BaseException):
    """Raised in a check's thread when the grader stops it (not an Exception: a student's
    `except Exception` must not swallow it)."""


def _shape_check_code():
    """The code objects of minidist.comm.checks' functions: the one caller allowed Allgather.
    Compared as code objects, not by the caller's module name, which a file can set itself."""
    from minidist.comm import checks
    return {f.__code__ for f in vars(checks).values()
            if callable(f) and getattr(f, "__module__", None) == checks.__name__ and hasattr(f, "__code__")}


def _array(buf):
    """The NumPy array of an mpi4py buffer argument: `a`, `[a, MPI.DOUBLE]` or `[a, n, MPI.DOUBLE]`."""
    return np.asarray(buf[0] if isinstance(buf, (list, tuple)) else buf)


class Session:
    """One check's communicators, its stop flag and what its thread is waiting for."""

    def __init__(self, world=None, split=False):
        world = MPI.COMM_WORLD if world is None else world
        self.comm = world.Dup()           # the student's messages
        self.ref = world.Dup()            # the check's own (referee, package shape check)
        self.stopped = threading.Event()
        self.receives = []                # (Irecv request handed to the student, what): cancelled on stop
        self.waiting = None               # "Recv from rank 2 at step 1" while blocked, else None
        self.sub = self.group = None
        if split:
            # groups of another size than the world's, so that a size written into the code
            # (divide by 4) fails at -n 4 too: ranks 0 .. N-2 form one group, rank N-1 another
            n, r = world.Get_size(), world.Get_rank()
            color = 1 if n > 1 and r == n - 1 else 0
            part = world.Split(color, r)
            self.group = list(range(n - 1)) if color == 0 and n > 1 else [r]   # its world ranks, in order
            self.sub = Session(part)      # a session of its own, stopped, drained and freed with this one
            part.Free()

    def rank(self):
        return self.comm.Get_rank()

    def size(self):
        return self.comm.Get_size()

    def counting(self, refuse):
        """A fresh CountingComm for one call of the student's function."""
        return CountingComm(self, refuse)

    def wait_for(self, done, what):
        """Poll done() until it is true; raise Stopped when the grader stops the check."""
        self.waiting = what
        try:
            while not done():
                if self.stopped.is_set():
                    raise Stopped(what)
                time.sleep(POLL_S)
        finally:
            self.waiting = None

    def recv_probed(self, comm, buf, source, tag, what, status=None):
        """Receive into buf after probing; returns (count of the message's bytes, Status).

        Returns the byte count without receiving when the message is longer than buf
        (the caller explains it): MPI would fail with "Message truncated".
        """
        st, found = MPI.Status(), []

        def probe():
            msg = comm.Improbe(source, tag, st)
            if msg is not None:
                found.append(msg)
            return msg is not None
        self.wait_for(probe, what)
        nbytes = st.Get_count(MPI.BYTE)
        if nbytes <= _array(buf).nbytes:
            found[0].Recv(buf, status)
        else:                       # too long for buf: take it into a scratch buffer, for the caller to explain
            req = found[0].Irecv([np.empty(nbytes, np.uint8), MPI.BYTE])
            self.wait_for(req.Test, what)
        return nbytes, st

    def allgather(self, mine, table):
        """Allgather over point-to-point on the referee communicator, stoppable.

        table[r] receives rank r's `mine`; the same table on every rank.
        """
        rank, n = self.rank(), self.size()
        mine, table = np.ascontiguousarray(mine), _array(table)
        rows = table.reshape(n, -1)
        rows[rank] = mine.reshape(-1)
        sends = [self.ref.Isend(mine, r, REFEREE_TAG) for r in range(n) if r != rank]
        for r in range(n):
            if r != rank:
                self.recv_probed(self.ref, rows[r], r, REFEREE_TAG, f"the check's exchange with rank {r}")
        self.wait_for(lambda: MPI.Request.Testall(sends), "the check's exchange")
        return table

    def stop(self):
        """Stop the check's thread: every wait raises Stopped, the student's receives are cancelled."""
        if self.sub is not None:
            self.sub.stop()
        self.stopped.set()
        for req, _ in self.receives:
            try:
                if req != MPI.REQUEST_NULL:
                    req.Cancel()
            except MPI.Exception:
                pass   # completed meanwhile

    def where(self):
        """Where the check's thread is, in words, for a time-out's message."""
        if self.waiting:
            return f"waiting in {self.waiting}"
        inner = self.sub.where() if self.sub is not None else ""
        if inner.startswith("waiting"):
            return f"in its group of {len(self.group)} ranks, {inner}"
        pending = [what for req, what in self.receives if req != MPI.REQUEST_NULL]
        if pending:   # the student waits on its requests inside MPI (Wait, Waitall), or forgot them
            return f"waiting with {', '.join(pending[:3])} not received"
        return "busy in Python (an endless loop?)"

    def drain(self):
        """Receive and drop every message sent to this rank: frees senders waiting for a partner."""
        if self.sub is not None:
            self.sub.drain()
        for comm in (self.comm, self.ref):
            st = MPI.Status()
            while (msg := comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)) is not None:
                msg.Recv([np.empty(st.Get_count(MPI.BYTE), np.uint8), MPI.BYTE])

    def free(self):
        if self.sub is not None:
            self.sub.free()
        self.comm.Free()
        self.ref.Free()


class CountingComm:
    """What the student's function gets as `comm`: point-to-point only, counted, stoppable.

    After the call: `bytes_sent`, `messages_sent`, `bytes_recv` (this rank's data),
    `check_bytes` (the package's shape check), `refused` (a sentence, or None) and
    `truncated` (a sentence, or None).
    """

    def __init__(self, session, refuse):
        self._s = session
        self._refuse = refuse              # the exercise's words for a refused collective
        self.bytes_sent = self.messages_sent = self.bytes_recv = self.check_bytes = 0
        self.receives = 0                  # receives so far: the ring's step, for messages
        self.refused = self.truncated = None

    # ------------------------------------------------------------------ who am I
    def Get_rank(self):
        return self._s.comm.Get_rank()

    def Get_size(self):
        return self._s.comm.Get_size()

    rank = property(Get_rank)
    size = property(Get_size)

    def py2f(self):
        return self._s.comm.py2f()

    # ------------------------------------------------------------------ counting
    def _count_send(self, buf):
        if self._s.stopped.is_set():
            raise Stopped("stopped")
        self.bytes_sent += _array(buf).nbytes
        self.messages_sent += 1

    def _receive(self, buf, source, tag, status, call):
        """A probed receive; a message longer than buf is explained, not truncated."""
        step, what = self.receives, f"{call} from rank {source} at step {self.receives}"
        self.receives += 1
        nbytes, st = self._s.recv_probed(self._s.comm, buf, source, tag, what, status)
        mine = _array(buf)
        if nbytes > mine.nbytes:
            item = mine.itemsize or 1
            self.truncated = (f"at step {step}, rank {self.Get_rank()} received {nbytes // item} elements "
                              f"from rank {st.Get_source()} where the ring sends {mine.size} (the chunk its "
                              "receive buffer is sized for): check which chunk you send")
            raise Misuse(self.truncated)
        self.bytes_recv += nbytes

    # ------------------------------------------------------------------ point-to-point, forwarded
    def Send(self, buf, dest, tag=0):
        # As a synchronous send (Issend): MPI may hold a small Send in a buffer and return
        # at once (the eager protocol), but a program that relies on that deadlocks on
        # large messages. Graded as if every Send waited for its Recv, a ring whose ranks
        # all Send first fails at any size, as the standard allows it to.
        self._count_send(buf)
        req = self._s.comm.Issend(buf, dest, tag)
        self._s.wait_for(req.Test, f"Send to rank {dest} ({_array(buf).size} elements)")

    def Ssend(self, buf, dest, tag=0):
        self._count_send(buf)
        req = self._s.comm.Issend(buf, dest, tag)
        self._s.wait_for(req.Test, f"Ssend to rank {dest} ({_array(buf).size} elements)")

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        self._receive(buf, source, tag, status, "Recv")

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None):
        self._count_send(sendbuf)
        req = self._s.comm.Isend(sendbuf, dest, sendtag)
        self._receive(recvbuf, source, recvtag, status, f"Sendrecv (sending to rank {dest}), receiving")
        self._s.wait_for(req.Test, f"Sendrecv, sending to rank {dest}")

    def Isend(self, buf, dest, tag=0):
        # As strict as Send: the request completes only when the receive is matched (Issend),
        # so `Isend; Wait; Recv` on two ranks that face each other deadlocks here at any
        # size, as it does under MPI past the eager limit.
        self._count_send(buf)
        return self._s.comm.Issend(buf, dest, tag)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        if self._s.stopped.is_set():
            raise Stopped("stopped")
        what = f"the Irecv from rank {source} of step {self.receives}"
        self.receives += 1
        self.bytes_recv += _array(buf).nbytes
        req = self._s.comm.Irecv(buf, source, tag)
        self._s.receives.append((req, what))
        return req

    def Iprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        return self._s.comm.Iprobe(source, tag, status)

    # ------------------------------------------------------------------ refused
    def Allgather(self, sendbuf, recvbuf):
        if sys._getframe(1).f_code in _shape_check_code():   # the package's shape check: allowed, counted apart
            self.check_bytes += _array(sendbuf).nbytes * (self.Get_size() - 1)
            self._s.allgather(_array(sendbuf), recvbuf)
            return
        self._refuse_call("Allgather")

    def _refuse_call(self, name):
        self.refused = f"rank {self.Get_rank()} called comm.{name}: {self._refuse}"
        raise Misuse(self.refused)

    def __getattr__(self, name):
        if name in COLLECTIVES:
            return lambda *args, **kwargs: self._refuse_call(name)
        if name[:1].islower() and hasattr(MPI.Comm, name):
            def pickled(*args, **kwargs):
                self.refused = (f"rank {self.Get_rank()} called comm.{name}, which pickles Python objects: "
                                "use the upper-case buffer methods (Send, Recv, Sendrecv) on NumPy arrays")
                raise Misuse(self.refused)
            return pickled
        raise AttributeError(f"the grader's communicator has no {name}: use Get_rank, Get_size, Send, "
                             "Recv, Sendrecv, Isend, Irecv and MPI.Request.Wait/Waitall")
