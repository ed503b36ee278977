"""A time-scaled cluster on one machine: every message pays for the link it would cross.

    MINIDIST_LINKS=nodes=2x4,intra=0:5.6e6,inter=0:6.3e5 \\
        mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 2 --pp 2 --dp 2

The ranks of the world are placed on simulated nodes in blocks (ranks 0..G-1 on node 0,
the next G on node 1, ...), as the ProcessGrid places a TP group's neighbouring ranks on
one node. Before a rank hands a message to MPI, it waits

    alpha + bytes / bandwidth          of the link between the two ranks' nodes

(intra: inside a node, NVLink on a real cluster; inter: between nodes, InfiniBand), the
alpha-beta cost of a message (Hockney 1994; docs/reference.md#the-alpha-beta-cost-model). MPI then
moves the bytes as fast as it can here, which adds this machine's own cost per message.

The variable's syntax (this project's own), comma-separated key=value items:

    nodes=NxG        N simulated nodes of G ranks; N * G must equal the world size
    intra=A:B        alpha A seconds and bandwidth B bytes/s per rank inside a node
    inter=A:B        the same between nodes (default: the intra link)
    scale=X          bandwidths divided by X (default 1): a cluster X times slower
    wait=sleep|spin  how a rank waits out the delay (default sleep; see below)

`scale` is how the cluster is time-scaled: with X = (the GPU's peak FLOP/s) / (this CPU's
FLOP/s per rank), a byte costs the same number of FLOPs here as on the real cluster, so
compute and communication keep the real cluster's ratio (minidist/lessons/plan_measure.py
measures the FLOP/s and builds X). Alphas are not scaled: a real 5 us alpha times X ~ 1e5 would be
half a second per message.

What is delayed: every upper-case send of a point-to-point message (Send, Ssend, Bsend,
Rsend, their I- forms, Sendrecv, Sendrecv_replace) on a wrapped communicator, by the
sender, before it posts the message; a non-blocking send therefore costs its sender the
transfer time at the call (the lessons wait for their sends at once; an engine that
overlaps would be charged more here than on a cluster). MPI's own collectives
(Allreduce, Bcast, ...) go through undelayed: in minidist they carry only the lessons'
bookkeeping (reports, agreement checks), never a strategy's data.

How a rank waits, on a machine whose ranks share few cores (8 ranks on 2 here):
wait=sleep (the default) sleeps out each delay, and every blocking receive, Sendrecv,
Wait and MPI collective of the wrapped communicator becomes its non-blocking twin tested
every POLL seconds with sleeps between (doze): a waiting rank takes no core from the
ranks that compute, as a waiting GPU takes nothing from the others, and is woken at once.
wait=spin busy-waits each delay and leaves MPI's own blocking calls, which poll without
pause (MPICH): a waiting rank then holds its core until its time slice ends.

With MINIDIST_LINKS unset nothing is wrapped and nothing changes. A malformed value is
bad input: rank 0 prints one line, every rank exits 2.
"""
import os
import sys
import time

from mpi4py import MPI

ENV = "MINIDIST_LINKS"
WAITS = ("sleep", "spin")
SENDS = ("Send", "Ssend", "Bsend", "Rsend", "Isend", "Issend", "Ibsend", "Irsend")
MAKERS = ("Dup", "Split", "Split_type", "Create", "Create_group")


class LinkError(ValueError):
    """A MINIDIST_LINKS value that cannot work (every rank reads the same one)."""


class Links:
    """The link model: nodes of G ranks, an (alpha, bandwidth) per link class, counters.

    `counts[cls]` = [messages, bytes, seconds waited] per link class ("intra", "inter"),
    this rank's sends since `reset()`: what the tests compare with the messages sent.
    """

    def __init__(self, nodes, per_node, intra, inter=None, scale=1.0, wait="sleep", placement=None):
        self.nodes, self.per_node = nodes, per_node
        self.links = {"intra": tuple(intra), "inter": tuple(inter or intra)}
        self.scale, self.wait = float(scale), wait
        # placement[r]: the node of world rank r; default in blocks of per_node ranks
        self.placement = list(placement) if placement is not None else None
        self.reset()

    def reset(self):
        self.counts = {c: [0, 0, 0.0] for c in self.links}

    def node(self, world_rank):
        if self.placement is not None:
            return self.placement[world_rank]
        return world_rank // self.per_node

    def link(self, a, b):
        """"intra" or "inter": the link between world ranks a and b."""
        return "intra" if self.node(a) == self.node(b) else "inter"

    def delay(self, a, b, nbytes):
        """Seconds a message of nbytes from world rank a to world rank b waits."""
        alpha, bw = self.links[self.link(a, b)]
        return alpha + nbytes * self.scale / bw

    def pay(self, a, b, nbytes):
        """Count the message and wait its delay (a and b are world ranks)."""
        cls = self.link(a, b)
        seconds = self.delay(a, b, nbytes)
        c = self.counts[cls]
        c[0] += 1
        c[1] += nbytes
        c[2] += seconds
        if seconds > 0:
            wait(seconds, self.wait)

    def spec(self):
        """The MINIDIST_LINKS text that builds this model again."""
        ia, ib = self.links["intra"]
        ea, eb = self.links["inter"]
        return (f"nodes={self.nodes}x{self.per_node},intra={ia:g}:{ib:g},inter={ea:g}:{eb:g},"
                f"scale={self.scale:g},wait={self.wait}")

    def __repr__(self):
        return f"Links({self.spec()})"


def wait(seconds, how="sleep"):
    """Let `seconds` pass: sleeping (the core is free meanwhile) or spinning on the clock."""
    end = time.perf_counter() + seconds
    if how == "sleep":
        time.sleep(seconds)
        return
    while time.perf_counter() < end:
        pass


POLL = 1e-4      # seconds a waiting rank sleeps between tests of its request (wait=sleep)


def doze(request, status=None):
    """Wait for an MPI request, sleeping POLL seconds between tests.

    MPICH's blocking calls poll without pause. On a machine whose ranks share few cores a
    rank waiting that way holds a core the others need, and gets it back only at its next
    time slice (measured here, 8 ranks on 2 cores: 2 to 10 ms per ring step); a sleeping
    rank is woken at once when its sleep ends, as a GPU that waits takes nothing from
    the others."""
    while not request.Test(status):
        time.sleep(POLL)


class DozingRequest(MPI.Request):
    """An MPI request whose Wait is doze()."""

    def Wait(self, status=None):
        doze(self, status)
        return True


def _number(text, what):
    try:
        v = float(text)
    except ValueError:
        raise LinkError(f"{what} must be a number, got {text!r}")
    if not (v == v and abs(v) != float("inf")):
        raise LinkError(f"{what} must be a finite number, got {text!r}")
    return v


def _link(text, name):
    parts = text.split(":")
    if len(parts) != 2:
        raise LinkError(f"{name}= takes ALPHA:BANDWIDTH (seconds:bytes per second), got {text!r}")
    alpha, bw = _number(parts[0], f"{name}'s alpha"), _number(parts[1], f"{name}'s bandwidth")
    if alpha < 0 or bw <= 0:
        raise LinkError(f"{name}= needs alpha >= 0 and bandwidth > 0, got {text!r}")
    return alpha, bw


def parse(text, world_size=None):
    """MINIDIST_LINKS text -> Links; anything malformed raises LinkError with one clear line."""
    items = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("nodes", "intra", "inter", "scale", "wait"):
            raise LinkError(f"unknown item {item!r}; expected nodes=NxG, intra=A:B, inter=A:B, "
                            f"scale=X, wait=sleep|spin")
        if key in items:
            raise LinkError(f"{key}= given twice")
        items[key] = value.strip()
    for key in ("nodes", "intra"):
        if key not in items:
            raise LinkError(f"{key}= is missing (e.g. nodes=2x4,intra=0:5e6,inter=0:6e5)")
    n, x, g = items["nodes"].partition("x")
    if not (x and n.isdigit() and g.isdigit() and int(n) >= 1 and int(g) >= 1):
        raise LinkError(f"nodes= takes NODESxRANKS_PER_NODE, e.g. 2x4, got {items['nodes']!r}")
    nodes, per_node = int(n), int(g)
    if world_size is not None and nodes * per_node != world_size:
        raise LinkError(f"nodes={nodes}x{per_node} places {nodes * per_node} ranks, but the world "
                        f"has {world_size}")
    scale = _number(items.get("scale", "1"), "scale")
    if scale <= 0:
        raise LinkError(f"scale must be more than 0, got {items['scale']!r}")
    how = items.get("wait", "sleep")
    if how not in WAITS:
        raise LinkError(f"wait= takes sleep or spin, got {how!r}")
    inter = _link(items["inter"], "inter") if "inter" in items else None
    return Links(nodes, per_node, _link(items["intra"], "intra"), inter, scale, how)


# ----------------------------------------------------------------------------- the wrapper

def _nbytes(buf):
    """Bytes of an mpi4py buffer spec: an array, [array, type] or [array, count, type]. (An
    array's own nbytes first: a device array, on the direct path, has no memoryview.)"""
    if isinstance(buf, (list, tuple)):
        if len(buf) == 3 and isinstance(buf[1], int) and isinstance(buf[2], MPI.Datatype):
            return buf[1] * buf[2].Get_size()
        buf = buf[0]
    nbytes = getattr(buf, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else memoryview(buf).nbytes


class LinkedComm:
    """An mpi4py communicator whose point-to-point sends wait for the link model first.

    Everything else is the wrapped communicator's own (Get_rank, Recv, Irecv, Allreduce,
    Get_attr, Free, ...). Communicators made from it (Split, Dup, ...) are wrapped too,
    so every sub-communicator of a ProcessGrid pays for the links of the world ranks it
    talks between.
    """

    def __init__(self, comm, links, world=None):
        world = world if world is not None else MPI.COMM_WORLD
        self._comm, self._links = comm, links
        group, wgroup = comm.Get_group(), world.Get_group()
        self._world_ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), wgroup)
        self._me = self._world_ranks[comm.Get_rank()]
        group.Free()
        wgroup.Free()
        self._world = world

    @property
    def comm(self):
        """The MPI communicator underneath."""
        return self._comm

    @property
    def links(self):
        return self._links

    def _pay(self, buf, dest):
        if dest == MPI.PROC_NULL:
            return
        self._links.pay(self._me, self._world_ranks[dest], _nbytes(buf))

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name in SENDS:
            def send(buf, dest, *args, **kw):
                self._pay(buf, dest)
                req = attr(buf, dest, *args, **kw)
                if isinstance(req, MPI.Request) and self._links.wait == "sleep":
                    return DozingRequest(req)
                return req
            return send
        if name in MAKERS:
            def make(*args, **kw):
                return self._wrap(attr(*args, **kw))
            return make
        return attr

    def _wrap(self, new):
        if new == MPI.COMM_NULL:
            return new
        return LinkedComm(new, self._links, self._world)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE,
                 recvtag=MPI.ANY_TAG, status=None):
        self._pay(sendbuf, dest)
        if self._links.wait != "sleep":
            return self._comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        rreq = self._comm.Irecv(recvbuf, source, recvtag)
        sreq = self._comm.Isend(sendbuf, dest, sendtag)
        doze(rreq, status)
        doze(sreq)

    # -- waiting: under wait=sleep, a rank waiting for MPI sleeps between tests
    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        if self._links.wait != "sleep":
            return self._comm.Recv(buf, source, tag, status)
        doze(self._comm.Irecv(buf, source, tag), status)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        req = self._comm.Irecv(buf, source, tag)
        return DozingRequest(req) if self._links.wait == "sleep" else req

    def _blocking(self, name, *args):
        """MPI's own blocking collective, as its non-blocking twin waited out by doze()."""
        if self._links.wait != "sleep":
            return getattr(self._comm, name)(*args)
        doze(getattr(self._comm, "I" + name.lower())(*args))      # Iallreduce, Ibarrier, ...

    def Barrier(self):
        self._blocking("Barrier")

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        self._blocking("Allreduce", sendbuf, recvbuf, op)

    def Allgather(self, sendbuf, recvbuf):
        self._blocking("Allgather", sendbuf, recvbuf)

    def Bcast(self, buf, root=0):
        self._blocking("Bcast", buf, root)

    def Sendrecv_replace(self, buf, dest, sendtag=0, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                         status=None):
        self._pay(buf, dest)
        return self._comm.Sendrecv_replace(buf, dest, sendtag, source, recvtag, status)

    def __eq__(self, other):
        return self._comm == (other._comm if isinstance(other, LinkedComm) else other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self._comm)

    def __repr__(self):
        return f"LinkedComm({self._comm!r}, {self._links!r})"


def unwrap(comm):
    """The MPI communicator under a LinkedComm (or comm itself)."""
    return comm.comm if isinstance(comm, LinkedComm) else comm


def wrap(comm, links):
    """comm, its sends delayed by `links` (a Links, or MINIDIST_LINKS text)."""
    if isinstance(links, str):
        links = parse(links, MPI.COMM_WORLD.Get_size())
    return LinkedComm(unwrap(comm), links)


_INSTALLED = {}


def from_environment(comm=None):
    """COMM_WORLD (or comm) wrapped as MINIDIST_LINKS says, or unchanged when it is unset.

    The same wrapper every time for one communicator, so the counters are one per process.
    A malformed value: rank 0 prints one line, every rank exits 2 (every rank reads the
    same variable, so every rank finds the same error).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    text = os.environ.get(ENV)
    if not text:
        return comm
    key = (text, id(comm))
    if key not in _INSTALLED:
        try:
            _INSTALLED[key] = wrap(comm, parse(text, MPI.COMM_WORLD.Get_size()))
        except LinkError as e:
            from minidist.failfast import agreed_exit
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(f"error: {ENV}={text!r}: {e}", file=sys.stderr, flush=True)
            agreed_exit(2)
    return _INSTALLED[key]
