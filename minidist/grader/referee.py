"""The referee of one check on every rank: run it in a thread, hear every rank's outcome,
agree on one verdict, and free whatever a stopped check left blocked in MPI.

Split from minidist/grader/command.py (which finds the files and checks, and prints) because this
is the part that must be right for the grader never to hang and never to pass a wrong
answer: a check runs in a thread so the main thread stays free; the main threads of all
ranks talk non-blocking on their own duplicate of COMM_WORLD, each announcing its outcome
the moment its check ends, so one rank's failure stops the others at once; the worst
outcome wins, and among failures the one that names its own cause, then the earliest.
"""
import re
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

PASS, TODO, FAIL = "PASS", "TODO", "FAIL"
# how bad a rank's outcome is; the worst over the ranks decides (STOPPED never does: a rank
# stops only because another reported something worse). S_MISUSE is a failure that names
# its own cause (a refused collective, a wrong-sized message: see grader/counting.Misuse):
# it beats the wrong values that other ranks compute from it, whichever came first.
S_PASS, S_STOPPED, S_TODO, S_TIMEOUT, S_FAIL, S_MISUSE = range(6)
MSG_BYTES = 2000            # a message is cut past this many bytes (UTF-8)
STATUS_BYTES = 1 + 8 + MSG_BYTES   # severity, time, message
POLL_S = 0.002
CAUSE_S = 0.5                 # after another rank's failure: how long this rank's check may still end on its own
GRACE_S = 3.0                 # after a stop: how long a check's thread may take to end
DEADLOCK = ("a deadlock? (every send needs a matching receive on the other rank, in an order "
            "that cannot wait in a circle: the grader's Send and Isend complete only when their Recv "
            "is posted, as MPI's do for large messages)")


def said(exc):
    """An exception in one line. MPI's errors come as a stack of internal calls; their last
    line is the one a student can act on ("Invalid rank has value 3 but must be ... less than 3")."""
    text = str(exc).strip()
    if type(exc).__module__.startswith("mpi4py") and text:
        said_by_mpi = re.sub(r"^\w+\(\d+\)\.?: ", "", text.splitlines()[-1])
        cls = exc.Get_error_class() if hasattr(exc, "Get_error_class") else None
        words = {MPI.ERR_RANK: "a rank outside the communicator", MPI.ERR_TRUNCATE: "a message longer than the "
                 "receive buffer", MPI.ERR_COUNT: "a bad element count", MPI.ERR_TAG: "a bad tag"}.get(cls)
        return f"MPI error: {words} ({said_by_mpi})" if words else f"MPI error: {said_by_mpi}"
    return f"{type(exc).__name__}: {text}"


def _library(filename):
    """True for the files of Python, NumPy, mpi4py and minidist: not a student's."""
    parts = Path(filename).parts
    return "minidist" in parts or "site-packages" in parts or "dist-packages" in parts \
        or filename.startswith((_STDLIB, "<"))


_STDLIB = sysconfig.get_paths()["stdlib"]


def where(exc):
    """The innermost line of the student's file in a traceback, for FAIL messages (a crash
    inside NumPy is shown at the student's line that called it)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.endswith(".py") and not _library(frame.filename):
            return f" (at line {frame.lineno} of {Path(frame.filename).name}: {frame.line})"
    return ""


# ----------------------------------------------------------------------------- one check, one rank

def start_check(check, fn, session=None):
    """Run check(fn[, session]) in a thread. Returns (thread, result): result["v"] is
    (severity, message) once the thread ends."""
    from_counting = sys.modules.get("minidist.grader.counting")
    stopped = from_counting.Stopped if from_counting else ()
    misuse = from_counting.Misuse if from_counting else ()
    result = {}

    def target():
        try:
            check(fn) if session is None else check(fn, session)
            result["v"] = (S_PASS, "")
        except NotImplementedError as e:
            result["v"] = (S_TODO, str(e) or "not implemented yet")
        except misuse as e:
            result["v"] = (S_MISUSE, str(e))
        except AssertionError as e:
            result["v"] = (S_FAIL, str(e) or "a check failed")
        except Exception as e:  # the student's code raised: show what and where
            result["v"] = (S_FAIL, f"{said(e)}{where(e)}")
        except BaseException as e:  # Stopped by the grader, or sys.exit() in a student's function
            if stopped and isinstance(e, stopped):
                result["v"] = (S_STOPPED, "stopped")
            else:
                result["v"] = (S_FAIL, f"the function called {type(e).__name__}({e}){where(e)}")

    def timed():
        target()
        result["t"] = time.time()      # when it ended: the earliest failure is usually the cause

    t = threading.Thread(target=timed, daemon=True)
    t.start()
    return t, result


class TimeLimit(BaseException):
    """Raised inside a check's thread when its time is up (not an Exception: a student's
    `except Exception:` does not swallow it)."""


def interrupt(thread, grace=GRACE_S):
    """End a check's thread that is still running Python code (an endless loop): raise
    TimeLimit in it, again every 50 ms (a bare `except:` may swallow one), until it ends or
    `grace` seconds pass. True when it ended.

    Why this and not a signal or a subprocess: the check runs in a thread (the main thread
    stays free to agree with the other ranks), and signal.alarm interrupts only the main
    thread; a subprocess per exercise would start Python and NumPy again for each, and lose
    the one process a class's job shares. CPython's PyThreadState_SetAsyncExc delivers an
    exception to another thread at its next bytecode: an endless loop ends, its `finally`
    blocks run (a plugged-in answer is put back), and the next exercise is graded. A thread
    blocked inside one C call (MPI, a huge NumPy operation) is not reached: still stuck."""
    import ctypes
    deadline = time.monotonic() + grace
    while thread.is_alive() and time.monotonic() < deadline:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(TimeLimit))
        thread.join(0.05)
    return not thread.is_alive()


def run_check(check, fn, timeout, session=None):
    """One process, no MPI: run check(fn[, session]) with a time limit. Returns (verdict, message, finished);
    a check still running Python code at the limit is interrupted (finished then says whether it ended)."""
    t, result = start_check(check, fn, session)
    t.join(timeout)
    if t.is_alive():
        where = session.where() if session is not None else "an endless loop?"
        ended = interrupt(t)
        return FAIL, f"did not finish within {timeout:g} s ({where})" + (": stopped there" if ended else ""), ended
    severity, message = result["v"]
    return word(severity), message, True


def word(severity):
    """PASS, TODO or FAIL for a rank's outcome (time-outs and misuse are failures)."""
    return {S_PASS: PASS, S_TODO: TODO}.get(severity, FAIL)


# ----------------------------------------------------------------------------- agreeing, under mpirun

def _encode(severity, message, when):
    """A status as bytes: severity, the time it happened (float64), the message."""
    buf = np.zeros(STATUS_BYTES, np.uint8)
    raw = message.encode("utf-8", "replace")[:MSG_BYTES]
    buf[0], buf[1:9] = severity, np.array([when], np.float64).view(np.uint8)
    buf[9:9 + len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def _decode(buf):
    return int(buf[0]), bytes(buf[9:]).rstrip(b"\0").decode("utf-8", "replace"), float(buf[1:9].view(np.float64)[0])


class Talk:
    """Every rank tells every other rank one status, non-blocking, on the control communicator."""

    def __init__(self, ctl, tag):
        self.ctl, self.tag = ctl, tag
        self.me, self.n = ctl.Get_rank(), ctl.Get_size()
        self.others = [r for r in range(self.n) if r != self.me]
        self.inbox = {r: np.zeros(STATUS_BYTES, np.uint8) for r in self.others}
        self.recvs = {r: ctl.Irecv(b, r, tag) for r, b in self.inbox.items()}
        self.heard, self.sends = {}, []

    def tell(self, severity, message, when=None):
        when = time.time() if when is None else when
        self.heard[self.me] = (severity, message, when)
        self.out = _encode(severity, message, when)
        self.sends = [self.ctl.Isend(self.out, r, self.tag) for r in self.others]

    def listen(self):
        """Collect what arrived; True when every rank (me too) has spoken."""
        for r, req in list(self.recvs.items()):
            if req.Test():
                self.heard[r] = _decode(self.inbox.pop(r))
                del self.recvs[r]
        return not self.recvs and self.me in self.heard

    def finish(self):
        from mpi4py import MPI
        MPI.Request.Waitall(self.sends)
        return self.heard


def settle(ctl, tag, thread, result, session, timeout):
    """Wait for this rank's check and hear every rank's outcome: {rank: (severity, message, when)}.

    This rank stops its own check when another rank reports a failure or a TODO (it is
    probably waiting for that rank) and reports a time-out when its limit passes, or when
    another rank timed out while this one is still running.
    """
    talk = Talk(ctl, tag)
    deadline = time.monotonic() + timeout
    failed_at = None                      # when this rank first heard of another's failure
    while True:
        everyone = talk.listen()
        if talk.me not in talk.heard:
            others = [s for s, _, _ in talk.heard.values()]
            now = time.monotonic()
            if failed_at is None and any(s in (S_TODO, S_FAIL, S_MISUSE) for s in others):
                failed_at = now
            if thread is None or not thread.is_alive():
                talk.tell(*result["v"], result.get("t"))
            elif now > deadline or S_TIMEOUT in others:
                talk.tell(S_TIMEOUT, session.where() if session is not None else "busy (an endless loop?)")
            elif failed_at is not None and (S_MISUSE in others or S_TODO in others or now - failed_at > CAUSE_S):
                # another rank's wrong values may be the consequence of this rank's misuse
                # (a wrong chunk it is about to receive): give this check CAUSE_S to say so
                talk.tell(S_STOPPED, "stopped")
            if talk.me in talk.heard and thread is not None and thread.is_alive() and session is not None:
                session.stop()
            elif talk.me not in talk.heard:     # wait a moment (or until the check ends), never spin:
                if thread is not None:          # a spinning main thread starves the check of the GIL
                    thread.join(POLL_S)
                else:
                    time.sleep(POLL_S)
            continue
        if everyone:
            return talk.finish()
        time.sleep(POLL_S)


def release(ctl, tag, thread, session):
    """After a check: free the threads stopped in MPI, then agree whether any rank's is stuck.

    Cancels this rank's pending receives and keeps dropping what others sent here until
    every rank's thread has ended (or GRACE_S passed). True when some rank's is stuck.
    """
    session.stop()
    talk = Talk(ctl, tag)
    grace = time.monotonic() + GRACE_S
    alive = lambda: thread is not None and thread.is_alive()   # noqa: E731  (None: not run here)
    while not talk.listen():
        session.drain()
        if talk.me not in talk.heard and (not alive() or time.monotonic() > grace):
            talk.tell(int(alive()), "")
        time.sleep(POLL_S)
    stuck = any(s for s, _, _ in talk.finish().values())
    if not stuck:
        session.free()
    elif "minidist.comm.watchdog" in sys.modules:   # reported already: its wait must not end the job
        sys.modules["minidist.comm.watchdog"].forget(thread)
    return stuck


def verdict_of(heard, timeout, multi_rank):
    """(verdict, message) from every rank's outcome: the worst wins, its rank named.

    Among failures the earliest in time wins: when rank 1 sends a wrong chunk and rank 0
    then computes garbage from it, rank 1's failure is the news. A message that every
    rank gave alike (a serial check) is not given a rank.
    """
    worst = max(s for s, _, _ in heard.values())
    ranks = sorted(r for r, (s, _, _) in heard.items() if s == worst)
    if worst >= S_FAIL:
        ranks.sort(key=lambda r: heard[r][2])
    n = len(heard)
    alike = len({m for _, m, _ in heard.values()}) == 1
    if worst == S_TIMEOUT:
        if n == 1 or (alike and not multi_rank):
            text = f"did not finish within {timeout:g} s: {heard[ranks[0]][1]}"
        else:
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            text = (f"{who} of {n} did not finish within {timeout:g} s: "
                    + "; ".join(f"rank {r} {heard[r][1]}" for r in ranks))
        if multi_rank and any("waiting" in heard[r][1] for r in ranks):
            text += f": {DEADLOCK}"
        return FAIL, text
    message = heard[ranks[0]][1]
    if worst >= S_FAIL and n > 1 and not alike and not message.startswith(("rank ", "at step ", "lesson ")):
        message = f"rank {ranks[0]}: {message}"
    if worst == S_STOPPED:
        message = "stopped (another rank failed)"
    return word(worst), message
