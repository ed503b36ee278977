"""Grade a lesson's exercise file.

    python -m minidist.grade lessons/exercises/00_autograd.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/01_collectives.py

Imports the student's file as a module and runs the lesson's checks on its functions
(minidist/lessons/checks/exNN_topic.py), one line per exercise:
  PASS  the function agrees with the check;
  FAIL  the first mismatch, in plain words (or the exception it raised);
  TODO  the stub still raises NotImplementedError.
Exit code 0 only when every exercise passes.

Under mpirun every rank runs every check; the verdicts are agreed with one of MPI's own
all-reduces (FAIL on any rank beats TODO beats PASS) and rank 0 prints them. Each check
runs in a thread with a time limit, so a ring that deadlocks is reported as FAIL instead
of hanging the class; the checks after it are not run, since its messages are still
in flight.
"""
import argparse
import importlib
import importlib.util
import os
import sys
import threading
import traceback
from pathlib import Path

import numpy as np

from minidist.failfast import agreed_exit

PASS, TODO, FAIL = 0, 1, 2
WORD = {PASS: "PASS", TODO: "TODO", FAIL: "FAIL"}
MSG_BYTES = 400  # a verdict's message travels as a fixed-size byte buffer


def load_student(path):
    """Import the file at `path` as a module, without touching sys.path."""
    spec = importlib.util.spec_from_file_location(f"student_{Path(path).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def checks_for(path):
    """lessons/exercises/00_autograd.py -> minidist.lessons.checks.ex00_autograd.EXERCISES."""
    name = f"minidist.lessons.checks.ex{Path(path).stem}"
    try:
        return importlib.import_module(name).EXERCISES
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        known = sorted(p.stem[2:] + ".py" for p in Path(__file__).parent.joinpath("lessons", "checks").glob("ex*.py"))
        raise SystemExit(f"error: no checks for {Path(path).name}; exercise files are: {', '.join(known)}")


def _where(exc):
    """The innermost line of the student's file in a traceback, for FAIL messages."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.endswith(".py") and "minidist" not in Path(frame.filename).parts:
            return f" (at line {frame.lineno} of {Path(frame.filename).name}: {frame.line})"
    return ""


def run_check(check, fn, timeout):
    """Run check(fn) in a thread. Returns (verdict, message, finished)."""
    result = {}

    def target():
        try:
            check(fn)
            result["v"] = (PASS, "")
        except NotImplementedError as e:
            result["v"] = (TODO, str(e) or "not implemented yet")
        except AssertionError as e:
            result["v"] = (FAIL, str(e) or "a check failed")
        except Exception as e:  # the student's code raised: show what and where
            result["v"] = (FAIL, f"{type(e).__name__}: {e}{_where(e)}")
        except BaseException as e:  # sys.exit() in a student's function
            result["v"] = (FAIL, f"the function called {type(e).__name__}({e}){_where(e)}")

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return FAIL, (f"did not finish within {timeout:g} s: a deadlock? (every send needs a "
                      "matching receive on the other rank, in an order that cannot wait in a circle)"), False
    return (*result["v"], True)


def agree(comm, verdict, message, finished=True):
    """Agree a verdict across ranks: the worst one wins, with its message naming the rank.

    Among failures, a concrete one (a wrong value, an exception) beats a time-out: when
    rank 1 computes garbage and rank 0 then waits for it, the garbage is the news.
    """
    if comm is None or comm.Get_size() == 1:
        return verdict, message
    severity = verdict + (1 if verdict == FAIL and finished else 0)  # PASS 0, TODO 1, FAIL 2-3
    codes = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([severity], dtype=np.int64), codes)
    src = int(np.argmax(codes))  # the lowest rank with the worst verdict
    worst = min(int(codes[src]), FAIL)
    buf = np.zeros(MSG_BYTES, dtype=np.uint8)
    if comm.Get_rank() == src:
        raw = message.encode("utf-8", "replace")[:MSG_BYTES]
        buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    comm.Bcast(buf, root=src)
    text = bytes(buf).rstrip(b"\0").decode("utf-8", "replace")
    if worst == FAIL and not text.startswith("rank "):
        text = f"rank {src}: {text}"
    return worst, text


def mpi_world():
    """COMM_WORLD when this is a job of several ranks (mpi4py imported only then)."""
    if not any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")):
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def grade(path, timeout=30.0, only=None, out=print):
    """Grade the file at `path`.

    Returns (exit code, [(number, name, verdict word, message)], stuck) where stuck says
    a check's thread is still blocked (a deadlock).
    """
    comm = mpi_world()
    root = comm is None or comm.Get_rank() == 0
    exercises = [e for e in checks_for(path) if only is None or e.number in only]
    try:
        student = load_student(path)
        load_error = None
    except Exception as e:
        student, load_error = None, f"the file does not import: {type(e).__name__}: {e}"
    lines, stuck = [], False
    for ex in exercises:
        finished = True                   # False: this rank's check timed out (or was not run)
        if stuck:
            verdict, msg, finished = FAIL, "not run: an earlier exercise did not finish", False
        elif load_error:
            verdict, msg = FAIL, load_error
        elif not callable(getattr(student, ex.name, None)):
            verdict, msg = FAIL, f"the file has no function named {ex.name}"
        else:
            verdict, msg, finished = run_check(ex.check, getattr(student, ex.name), timeout)
            stuck = not finished
            if comm is not None:  # if any rank is stuck, all stop after this exercise
                stuck = _any(comm, stuck)
        verdict, msg = agree(comm, verdict, msg, finished)
        lines.append((ex.number, ex.name, WORD[verdict], msg))
        if root:
            tail = f": {msg}" if msg and verdict != PASS else ""
            out(f"{WORD[verdict]}  {ex.number} {ex.name}{tail}")
    n_pass = sum(v == "PASS" for _, _, v, _ in lines)
    if root:
        out(f"{n_pass}/{len(lines)} exercises pass")
    code = 0 if n_pass == len(lines) else 1
    return code, lines, stuck


def _any(comm, flag):
    """True on every rank if flag is True on any (one of MPI's own all-reduces)."""
    from mpi4py import MPI
    buf = np.array([int(flag)], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return bool(buf[0])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidist.grade", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="an exercise file, e.g. lessons/exercises/00_autograd.py")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one check may take (default %(default)s)")
    p.add_argument("--only", nargs="+", metavar="N.M", help="grade only these exercises, e.g. --only 0.2")
    args = p.parse_args(argv)
    if not Path(args.file).is_file():
        comm = mpi_world()
        if comm is None or comm.Get_rank() == 0:
            print(f"error: no such file: {args.file}", file=sys.stderr)
        return 2
    code, _, stuck = grade(args.file, args.timeout, set(args.only) if args.only else None)
    sys.stdout.flush()
    if stuck:  # a thread is blocked inside MPI forever: MPI_Finalize would wait for it
        comm = mpi_world()
        if comm is not None:
            comm.Barrier()
        os._exit(code)
    return code


if __name__ == "__main__":
    agreed_exit(main())  # the verdicts are agreed: every rank exits alike
