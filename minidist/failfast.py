"""One rank's crash ends the whole MPI job, with that rank's traceback shown once.

Why: in MPI an uncaught exception on one rank ends that process only; the other ranks
sit in their next receive forever (the job hangs until someone kills it). `import
minidist` installs hooks for uncaught exceptions, in the main thread (sys.excepthook)
and in other threads (threading.excepthook), that

  1. print "[rank r] uncaught exception" and the traceback to stderr, flushed, once;
  2. call MPI_Abort on COMM_WORLD when the job has more than one rank, which makes
     mpirun end every rank within a second or two with a non-zero exit code.

Installing is cheap: nothing here imports mpi4py. The hook looks in sys.modules; a
program that never imported mpi4py.MPI has no job to abort.

An `AgreedError` is different: every rank raised it alike, after agreeing (a shape
mismatch found by a collective's check, a grid that does not fit the world). Nobody is
left waiting, so the hook prints it on rank 0 only and lets every rank exit normally.
Errors of bad input that a lesson reports in one line and exit 2 are the lesson
harness's business (minidist.lessons.harness.InputError) and never reach these hooks.

`sys.exit(code)` on one rank alone hangs a job too: the exiting rank waits in
MPI_Finalize for ranks that wait for it. So `install()` also records the code of every
sys.exit() and, at exit, aborts the job when the code is non-zero, the job has several
ranks and the exit was not declared agreed (`agreed_exit(code)`: bad input that every
rank found, a verdict that every rank shares). Python's atexit hooks run before mpi4py
finalizes MPI, so the abort still reaches the other ranks.
"""
import atexit
import sys
import threading
import time
import traceback

ABORT_DELAY_S = 1.0
_installed = False
_exit = {"code": None, "agreed": False}   # the last sys.exit() of this process
_reported = threading.Lock()      # taken by the first failure; later ones stay quiet


class AgreedError(ValueError):
    """An error raised on every rank alike, so no rank is left waiting."""


def _mpi_world():
    """(rank, size, COMM_WORLD) if MPI is imported and running, else (0, 1, None)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return 0, 1, None
    w = MPI.COMM_WORLD
    return w.Get_rank(), w.Get_size(), w


def report_and_abort(text, code=1):
    """Print `text` (a traceback, a failed test's report) once, then end the whole job.

    With one rank (or no MPI) it only prints; the caller decides how to end.
    """
    rank, size, world = _mpi_world()
    if _reported.acquire(blocking=False):
        sys.stdout.flush()
        prefix = f"[rank {rank}] " if size > 1 else ""
        sys.stderr.write(f"{prefix}{text.rstrip()}\n")
        if size > 1:
            sys.stderr.write(f"[rank {rank}] aborting all {size} ranks (minidist fail-fast)\n")
        sys.stderr.flush()
    if world is not None and size > 1:
        # mpirun forwards each rank's stderr asynchronously; Abort kills the forwarding
        # too, and under load the message was lost (seen here). A second lets it out.
        time.sleep(ABORT_DELAY_S)
        world.Abort(code)


def _handle(exc_type, exc, tb, where):
    rank, size, _ = _mpi_world()
    if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
        return False
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if isinstance(exc, AgreedError) and where == "main":
        # every rank has the same error: one copy of it is enough, and no one hangs
        if rank == 0 and _reported.acquire(blocking=False):
            sys.stderr.write(text)
            sys.stderr.flush()
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


def _recording_exit(code=None):
    """sys.exit, remembering the code for the check at exit."""
    _exit["code"] = code
    raise SystemExit(code)


def agreed_exit(code):
    """Exit with `code`, which every rank reaches alike: no rank is left waiting."""
    _exit["agreed"] = True
    sys.exit(code)


def _check_exit():
    code = _exit["code"]
    if code in (None, 0) or _exit["agreed"]:
        return
    report_and_abort(f"sys.exit({code!r}) on this rank; the other ranks might wait for it forever",
                     code if isinstance(code, int) else 1)


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
    atexit.register(_check_exit)
    _installed = True
