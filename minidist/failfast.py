"""No rank is ever left waiting: a crash, an exit or an error on one rank ends the whole job.

Why: in MPI a process that stops ends itself only. The other ranks sit in their next
receive forever, and the job hangs until someone kills it, with nothing on the screen.
`import minidist` installs two guards (nothing here imports mpi4py: the guards look in
sys.modules, and a program that never started MPI has no job to end).

1. Uncaught exceptions, in the main thread (sys.excepthook) or any other
   (threading.excepthook): print "[rank r] uncaught exception" and the traceback once,
   flushed, then MPI_Abort, which makes mpirun end every rank within a second or two.

2. Every exit, whatever its path: the end of the script, `sys.exit(0)`, `sys.exit(3)`,
   the builtin `exit(3)`, `raise SystemExit(3)`, an error that every rank raised alike.
   At exit (atexit, before mpi4py finalizes MPI) each rank tells every other one "I am
   ending" (one small message each, tag EXIT_TAG on COMM_WORLD) and waits for the same
   from all of them, at most EXIT_TIMEOUT seconds (MINIDIST_EXIT_TIMEOUT, default 10).
   All arrive: the job ends normally, each rank with its own exit code. Some do not
   arrive: they are still busy, most likely waiting in a collective for this rank. This
   rank prints why it is ending and who is missing, and aborts the job. The wait sleeps
   between polls, so ranks that end a few seconds apart (rank 0 printing a long report)
   cost nothing; ranks meant to end minutes apart need a larger MINIDIST_EXIT_TIMEOUT.

An `AgreedError` (a shape mismatch found by a collective's check, a grid that does not
fit the world) is raised on every rank alike, after agreeing. One copy of its message is
enough, so the hook prints nothing at once; at exit the lowest rank that raised it prints
it. The type is a claim, not a proof: if the other ranks do not reach their end in time
(`ProcessGrid(tp=3 if rank == 0 else 1)` raises on rank 0 only), the exit agreement
above prints the error with the missing ranks and aborts. `agreed_exit(code)` is
`sys.exit(code)` for exits that every rank reaches alike (bad input that every rank
found, a verdict that every rank shares); it is verified the same way.

Reports go to `report_stream()`: sys.stderr, unless a test harness that captures
stderr points it elsewhere (tests/mpi/conftest.py does: pytest's capture would swallow
a report printed just before MPI_Abort).
"""
import array
import atexit
import builtins
import os
import sys
import threading
import time
import traceback

ABORT_DELAY_S = 1.0
EXIT_TIMEOUT = float(os.environ.get("MINIDIST_EXIT_TIMEOUT", "10"))
EXIT_TAG = 32701                  # the collectives keep tags up to 30999; users below 20000

_installed = False
_exit = {"how": None, "code": 1}  # how the main thread last asked to exit, in words
_agreed_error = {"text": None}    # an AgreedError waiting to be printed at exit
_reported = threading.Lock()      # taken by the first failure; later ones stay quiet
_stream = {"file": None}


class AgreedError(ValueError):
    """An error raised on every rank alike, so no rank is left waiting (verified at exit)."""


def _mpi_world():
    """(rank, size, COMM_WORLD) if MPI is imported and running, else (0, 1, None)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return 0, 1, None
    w = MPI.COMM_WORLD
    return w.Get_rank(), w.Get_size(), w


def report_stream():
    """Where failure reports go: sys.stderr unless report_to() chose another file."""
    return _stream["file"] or sys.stderr


def report_to(file):
    """Send failure reports (and the watchdog's stacks) to `file` instead of sys.stderr."""
    _stream["file"] = file


def say(text):
    """Write `text` to the report stream at once, every line prefixed with this rank."""
    rank, size, _ = _mpi_world()
    prefix = f"[rank {rank}] " if size > 1 else ""
    out = report_stream()
    out.write("".join(prefix + line + "\n" for line in text.rstrip().split("\n")))
    out.flush()


def report_and_abort(text, code=1):
    """Print `text` (a traceback, a failed test's report) once, then end the whole job.

    With one rank (or no MPI) it only prints; the caller decides how to end.
    """
    rank, size, world = _mpi_world()
    if _reported.acquire(blocking=False):
        sys.stdout.flush()
        out = report_stream()
        prefix = f"[rank {rank}] " if size > 1 else ""
        out.write(f"{prefix}{text.rstrip()}\n")
        if size > 1:
            out.write(f"[rank {rank}] aborting all {size} ranks (minidist fail-fast)\n")
        out.flush()
    if world is not None and size > 1:
        # mpirun forwards each rank's stderr asynchronously; Abort kills the forwarding
        # too, and under load the message was lost (seen here). A second lets it out.
        time.sleep(ABORT_DELAY_S)
        world.Abort(code if isinstance(code, int) and 0 < code < 256 else 1)


# ----------------------------------------------------------------------------- uncaught exceptions

def _handle(exc_type, exc, tb, where):
    if issubclass(exc_type, SystemExit):
        return False
    _, size, _ = _mpi_world()
    if issubclass(exc_type, KeyboardInterrupt) and size == 1:
        return False                      # one process: Python's own traceback, as always
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if issubclass(exc_type, KeyboardInterrupt):
        # Ctrl-C (SIGINT) reached this rank: the others would wait for it in their next
        # collective, so end the job now rather than after the exit agreement's wait
        report_and_abort(f"interrupted (KeyboardInterrupt):\n{text}", 130)
        return True
    if isinstance(exc, AgreedError) and where == "main":
        _, size, _ = _mpi_world()
        if size == 1:
            report_stream().write(text)
            report_stream().flush()
        else:
            _agreed_error["text"] = text      # printed at exit, by one rank only
        return True
    report_and_abort(f"uncaught exception{where != 'main' and ' in a thread' or ''}:\n{text}")
    return True


def _excepthook(exc_type, exc, tb):
    if not _handle(exc_type, exc, tb, "main"):
        _previous_excepthook(exc_type, exc, tb)


def _thread_excepthook(args):
    if args.exc_type is SystemExit or not _handle(args.exc_type, args.exc_value,
                                                  args.exc_traceback, "thread"):
        _previous_thread_excepthook(args)


# ----------------------------------------------------------------------------- exits

def _note_exit(how, code):
    """Remember how the main thread asked to exit (for the message and the abort's code,
    if the exit agreement fails). A SystemExit that someone catches leaves a stale note:
    it only changes words."""
    if threading.current_thread() is threading.main_thread():
        _exit["how"] = how
        _exit["code"] = code if isinstance(code, int) and 0 < code < 256 else 1


def _recording_exit(code=None):
    """sys.exit, remembering the code for the message at exit."""
    _note_exit(f"sys.exit({code!r})", code)
    raise SystemExit(code)


def agreed_exit(code):
    """Exit with `code`, which every rank reaches alike: no rank is left waiting."""
    _note_exit(f"agreed_exit({code!r})", code)
    raise SystemExit(code)


def _recording_quitter(quitter):
    """The builtin exit()/quit(), remembering the code like sys.exit."""
    class RecordingQuitter(type(quitter)):
        def __call__(self, code=None):
            _note_exit(f"{self.name}({code!r})", code)
            super().__call__(code)
    return RecordingQuitter(quitter.name, quitter.eof)


def _exchange(world, mine, timeout):
    """Tell every rank this one is ending (with `mine`: 1 = an agreed error to print) and
    hear the same from all, waiting at most `timeout` s. Returns ({rank: theirs}, missing)."""
    MPI = sys.modules["mpi4py.MPI"]
    rank, size = world.Get_rank(), world.Get_size()
    peers = [p for p in range(size) if p != rank]
    out = array.array("q", [mine])
    got = {p: array.array("q", [0]) for p in peers}
    recvs = {p: world.Irecv([got[p], MPI.INT64_T], p, EXIT_TAG) for p in peers}
    sends = [world.Isend([out, MPI.INT64_T], p, EXIT_TAG) for p in peers]
    deadline, pause = time.monotonic() + timeout, 0.0005
    pending = set(peers)
    while True:
        pending = {p for p in pending if not recvs[p].Test()}
        if not pending and MPI.Request.Testall(sends):
            return {p: got[p][0] for p in peers}, []
        if time.monotonic() > deadline:
            return None, sorted(pending)
        time.sleep(pause)               # sleep, do not spin: ranks share cores
        pause = min(2 * pause, 0.05)


def _ranks(rs):
    return ", ".join(str(r) for r in rs)


def _at_exit():
    """The exit agreement (see the module's docstring)."""
    rank, size, world = _mpi_world()
    error = _agreed_error["text"]
    if world is None or size == 1:
        return
    try:
        sys.stdout.flush()
    except (OSError, ValueError):     # stdout closed or gone: nothing to flush
        pass
    theirs, missing = _exchange(world, 1 if error else 0, EXIT_TIMEOUT)
    if missing:
        how = _exit["how"] or "its program returned or raised SystemExit"
        what = (f"raised an error meant to be raised by every rank alike:\n{error.rstrip()}\n"
                f"but rank(s) {_ranks(missing)} did not raise it") if error else \
               f"is ending ({how}), but rank(s) {_ranks(missing)} did not end"
        report_and_abort(f"this rank {what} within {EXIT_TIMEOUT:g} s: they are probably waiting "
                         f"for this rank in a collective it skipped (MINIDIST_EXIT_TIMEOUT sets the wait)",
                         _exit["code"])
        return
    raised = sorted([rank] * bool(error) + [p for p, v in theirs.items() if v])
    if error and rank == raised[0]:     # one copy of the message, from the lowest rank
        if len(raised) == size:
            report_stream().write(error)
        else:
            say(f"{error.rstrip()}\n(raised on rank(s) {_ranks(raised)} of {size}; "
                "the others ended without it)")
        report_stream().flush()


_previous_excepthook = sys.excepthook
_previous_thread_excepthook = threading.excepthook


def install():
    """Install the hooks (idempotent; `import minidist` calls it)."""
    global _installed, _previous_excepthook, _previous_thread_excepthook
    if _installed:
        return
    _previous_excepthook = sys.excepthook
    _previous_thread_excepthook = threading.excepthook
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    sys.exit = _recording_exit
    for name in ("exit", "quit"):
        if hasattr(builtins, name) and hasattr(getattr(builtins, name), "eof"):
            setattr(builtins, name, _recording_quitter(getattr(builtins, name)))
    atexit.register(_at_exit)
    _installed = True
