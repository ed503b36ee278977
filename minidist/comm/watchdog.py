"""The watchdog: a wait in minidist's communication that lasts too long ends the job, loudly.

Why: a deadlock (two ranks that both receive first, ranks that called different
collectives, a rank stuck in an endless loop while the others wait for it) shows
nothing: every rank waits, quietly, forever. PyTorch's NCCL watchdog gives a collective
a time limit; so does this one.

    MINIDIST_TIMEOUT=300   seconds one communication call may wait (default 300; 0: off)

How: every collective marks its thread as waiting (`with waiting("ring_all_reduce"):`,
a clock read and a dict write, nothing on the wire). One daemon thread per process wakes
every POLL_S seconds. When a mark is older than the limit it prints this rank's stacks
and what it waits in, asks every other rank to print theirs (one small message each, tag
DUMP_TAG on COMM_WORLD, which the other ranks' watchdog threads look for with Iprobe),
gives them DUMP_GRACE_S seconds, and aborts the job. A rank asked to print, prints
once: its stacks and what it waits in, or "not inside minidist communication", in which
case its stack shows where it is stuck instead (an endless loop, a forgotten call).

The thread needs MPI_THREAD_MULTIPLE, mpi4py's default: MPI releases Python's lock while
a call blocks, so the watchdog thread runs beside a main thread stuck in MPI, and beside
a main thread looping in Python (which yields the lock every few milliseconds).
It starts when minidist.comm is imported in a job of more than one rank, and stops at
exit, before MPI finalizes.
"""
import atexit
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

from minidist import failfast

TIMEOUT = 300.0                   # read again from MINIDIST_TIMEOUT when the thread starts
POLL_S = 0.5
DUMP_GRACE_S = 2.0
DUMP_TAG = 32702

_marks = {}                       # thread id -> (monotonic start, what it waits in)
_state = {"thread": None, "dumped": False}
_stop = threading.Event()
_lock = threading.Lock()          # one dump per process


class waiting:
    """`with waiting("ring_all_reduce"):` marks this thread as waiting in communication.

    Nested marks keep the outermost one (an all-reduce built from a reduce and a broadcast
    is one wait). A class, not a generator: it runs around every collective, so it is kept
    to a few hundred nanoseconds.
    """
    __slots__ = ("what", "outer")

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        me = threading.get_ident()
        self.outer = _marks.get(me)
        if self.outer is None:
            _marks[me] = (time.monotonic(), self.what)
        return self

    def __exit__(self, *exc):
        if self.outer is None:
            _marks.pop(threading.get_ident(), None)


def where():
    """What each thread of this process waits in, and for how long, in words."""
    now, names = time.monotonic(), {t.ident: t.name for t in threading.enumerate()}
    lines = [f"thread {names.get(tid, tid)}: waiting {now - t0:.1f} s in {what}"
             for tid, (t0, what) in list(_marks.items())]
    return "\n".join(lines) or "not inside minidist communication"


def stacks():
    """Every thread's stack but the watchdog's own, as text."""
    me, names = threading.get_ident(), {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for tid, frame in sys._current_frames().items():
        if tid != me:
            parts.append(f"stack of thread {names.get(tid, tid)} (most recent call last):\n"
                         + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def dump(reason):
    """Print this rank's reason, waits and stacks once, as one block."""
    with _lock:
        if _state["dumped"]:
            return False
        _state["dumped"] = True
    failfast.say(f"minidist watchdog: {reason}\n{where()}\n{stacks()}")
    return True


def _expired():
    now = time.monotonic()
    for t0, what in list(_marks.values()):
        if now - t0 > TIMEOUT:
            return what, now - t0
    return None


def _loop(world):
    rank, size = world.Get_rank(), world.Get_size()
    asked = bytearray(8)
    while not _stop.wait(POLL_S):
        if world.Iprobe(MPI.ANY_SOURCE, DUMP_TAG):       # another rank's watchdog fired
            status = MPI.Status()
            world.Recv([asked, MPI.BYTE], MPI.ANY_SOURCE, DUMP_TAG, status)
            dump(f"rank {status.Get_source()}'s watchdog asked for this rank's stack")
        late = _expired()
        if late is None:
            continue
        what, seconds = late
        dump(f"waited {seconds:.0f} s in {what} (limit MINIDIST_TIMEOUT={TIMEOUT:g} s): a "
             "deadlock, or a rank that never came; asking every rank for its stack")
        for peer in range(size):
            if peer != rank:
                world.Isend([asked, MPI.BYTE], peer, DUMP_TAG)
        time.sleep(DUMP_GRACE_S)                           # let them print
        failfast.report_and_abort(f"minidist watchdog: {what} did not finish within {TIMEOUT:g} s")
        return


def start():
    """Start the watchdog thread once, in a job of more than one rank (when enabled)."""
    global TIMEOUT
    TIMEOUT = float(os.environ.get("MINIDIST_TIMEOUT", TIMEOUT))
    world = MPI.COMM_WORLD
    if _state["thread"] is not None or TIMEOUT <= 0 or world.Get_size() == 1:
        return
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return                  # MPI forbids a second thread's calls: no watchdog
    _state["thread"] = threading.Thread(target=_loop, args=(world,), name="minidist-watchdog",
                                        daemon=True)
    _state["thread"].start()
    atexit.register(stop)       # runs before failfast's exit agreement (atexit is LIFO)


def stop():
    """Stop the thread (at exit: no MPI call from it may overlap MPI_Finalize)."""
    _stop.set()
    thread = _state["thread"]
    if thread is not None and thread is not threading.current_thread():
        thread.join(POLL_S + 1.0)


def forget(thread):
    """Stop watching `thread` (a grader's check thread left blocked on purpose: the
    grader has reported it and moves on; its wait must not end the job later)."""
    _marks.pop(thread.ident, None)
