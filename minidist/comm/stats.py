"""Byte and message counters, per collective, for this process.

Every collective in minidist.comm adds what it sends and receives here, under its own
name ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
"all_to_all", "send", "recv"). The small control messages that check shapes and dtypes
across ranks (and the headers of send/recv) go under "check", never into the data
bytes, so a lesson can print measured data bytes beside docs/reference.md's formula:

    from minidist.comm import stats, ring_all_reduce
    with stats.measure() as m:
        ring_all_reduce(comm, x)
    m["all_reduce"]["bytes_sent"]      # == 2 * (N-1) / N * x.nbytes when N divides x.size

A collective built from another (ring all-reduce = reduce-scatter + all-gather) counts
under the outer name only: `counting("all_reduce")` claims the name for the thread, and
inner calls keep it. MPI's own collectives (impl="mpi") count calls only, under
"mpi_<name>": MPI does not tell us what travels on its wires.
"""
import threading
from contextlib import contextmanager

FIELDS = ("bytes_sent", "bytes_recv", "messages", "calls")

_lock = threading.Lock()          # a communication thread may count beside the main one
_counts = {}                      # name -> {field: int}
_local = threading.local()        # the collective this thread is inside, if any


def _row(name):
    row = _counts.get(name)
    if row is None:
        row = _counts[name] = dict.fromkeys(FIELDS, 0)
    return row


def add(name=None, sent=0, recv=0, messages=0, calls=0):
    """Add to the counters of `name` (or of the collective this thread is inside)."""
    name = getattr(_local, "name", None) or name
    with _lock:
        row = _row(name)
        row["bytes_sent"] += int(sent)
        row["bytes_recv"] += int(recv)
        row["messages"] += int(messages)
        row["calls"] += int(calls)


def add_check(sent=0, recv=0, messages=1):
    """Count a shape/dtype agreement message: always under "check", whoever asks."""
    with _lock:
        row = _row("check")
        row["bytes_sent"] += int(sent)
        row["bytes_recv"] += int(recv)
        row["messages"] += int(messages)


@contextmanager
def counting(name):
    """Attribute the traffic of this block to collective `name` (the outermost name wins)."""
    outer = getattr(_local, "name", None)
    if outer is None:
        _local.name = name
        add(name, calls=1)
    try:
        yield
    finally:
        if outer is None:
            _local.name = None


def reset():
    """Forget every count."""
    with _lock:
        _counts.clear()


def snapshot():
    """{name: {bytes_sent, bytes_recv, messages, calls}}: a copy, safe to keep."""
    with _lock:
        return {name: dict(row) for name, row in _counts.items()}


def diff(after, before):
    """after - before, dropping names whose counts did not change."""
    out = {}
    for name, row in after.items():
        old = before.get(name, {})
        delta = {f: row[f] - old.get(f, 0) for f in FIELDS}
        if any(delta.values()):
            out[name] = delta
    return out


class Measurement(dict):
    """The counts of one region: {name: {field: int}}, filled when the block ends."""

    def bytes_sent(self, name):
        return self.get(name, {}).get("bytes_sent", 0)

    def bytes_recv(self, name):
        return self.get(name, {}).get("bytes_recv", 0)

    def messages(self, name):
        return self.get(name, {}).get("messages", 0)


@contextmanager
def measure():
    """`with stats.measure() as m:` ... afterwards m holds what this process moved inside."""
    m = Measurement()
    before = snapshot()
    try:
        yield m
    finally:
        m.update(diff(snapshot(), before))
