"""The plug-in check: the student's function in place of the package's answer, and the
lesson run on it.

A unit check tries a function on the inputs its author thought of. The lesson is the
real use: the function called many times, in float32 and float64, on shapes the unit
check never tried, beside the rest of the package. So after an exercise's unit check
PASSes, the grader puts the student's function where the package's answer is (every
module of minidist that holds the answer under its name, and the tables that list it),
runs the lesson's own equivalence at a small shape on the graded ranks, and puts the
package's answer back. An answer that makes the lesson MISMATCH, crash or hang FAILs,
and the message names the lesson setting it broke, as the lesson's command line (where
the package's own answer matches), and what the lesson found:

    FAIL  6.2 free_params: lesson 06 with your free_params (mpirun -n 3 python -m
          minidist.lessons.06_fsdp --n-layer 4 ... --dtype float32): crashed: ...

How the lesson runs: `harness.running(comm)` makes the lesson's main() use `comm`
instead of COMM_WORLD and print nothing; its report comes back to this module. A run
marked ranks=k uses the job's first k ranks (a group split off a duplicate of the
world), ranks=1 one process; the other ranks wait for the verdict. Each run happens in
float64 and in float32 (the lesson's tolerance for each), unless the run says otherwise.

What it cannot do: free a rank blocked inside MPI by a broken answer (the package's
collectives block in MPI, not in the grader's stoppable communicator). A hang is a
time-out as in any check; the grader then runs nothing more in that job (the teacher's
form grades each file in jobs of its own), and exits without waiting for the blocked thread.
"""
import contextlib
import importlib
import inspect
import shlex
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from minidist.grader.referee import said, where


@dataclass(frozen=True)
class Run:
    """One lesson setting of a plug-in check."""
    lesson: str                               # "06_fsdp": minidist.lessons.06_fsdp
    argv: object = ()                         # its flags at a small shape (no --dtype, no --json), or
                                              # a function of the lesson's rank count that returns them
    ranks: int = 0                            # 0: every rank of the job; k: the first k ranks (1: one process)
    dtypes: tuple = ("float64", "float32")  # (None,): a lesson that takes no --dtype (12_plan)
    judge: object = None                      # report -> True when the run passes (None: the report's "match")
    figures: object = None                    # report -> {name: value} that must equal the package's own run
                                              # of the same setting (a lesson's MATCH may not look at them)
    together: bool = False                    # run once more with every exercise that runs it plugged in at
                                              # once: there one's result is another's input (check_together)

    def flags(self, n, dtype):
        return [*(self.argv(n) if callable(self.argv) else self.argv),
                *(("--dtype", dtype) if dtype is not None else ())]

    def command(self, n, dtype):
        flags = " ".join(shlex.quote(a) for a in self.flags(n, dtype))
        run = f"python -m minidist.lessons.{self.lesson} {flags}"
        return run if n == 1 else f"mpirun -n {n} {run}"


LESSON_RUN_S = 60.0     # the least time one lesson run may take, whatever --timeout says


def time_limit(ex, timeout):
    """Seconds exercise ex's plug-in check may take: each lesson run gets --timeout, and at
    least LESSON_RUN_S (a short --timeout is for the unit checks' deadlocks; a lesson run
    on a loaded machine may need longer, and a hang there is rare)."""
    return max(timeout, LESSON_RUN_S) * sum(len(r.dtypes) for r in ex.runs)


def counted(fn, module):
    """fn, counting its calls in .calls (a run that never reaches it proves nothing).

    The wrapper is made in a namespace named after the package module the answer lives in,
    so that to the student's function it looks called from there, as it is without the
    grader: an answer that behaves differently when the grader calls it is caught here.
    """
    space = {"__name__": module, "fn": fn, "takes": _keywords(fn)}
    exec("def call(*args, **kwargs):\n    call.calls += 1\n    if takes is not None:\n"
         "        kwargs = {k: v for k, v in kwargs.items() if k in takes}\n"
         "    return fn(*args, **kwargs)\n", space)
    call = space["call"]
    call.calls = 0
    return call


def _keywords(fn):
    """The keywords fn takes, or None when it takes any (**kwargs) or cannot tell. A keyword
    the package passes and the student's signature lacks is left out of the call: the unit
    check called it with every keyword of the exercise, so such a keyword is the package's
    own (ring_all_reduce's `check`, its inputs' agreement, which lessons turn off)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _holders(reference):
    """Every (namespace, key) in minidist's modules (not the grader's) that holds `reference`:
    module attributes (`from x import f` copies the name) and module-level dicts (tables of
    schedules)."""
    found = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("minidist.") or name.startswith("minidist.grader") or mod is None:
            continue
        space = vars(mod)
        for key, value in list(space.items()):
            if value is reference:
                found.append((space, key))
            elif isinstance(value, dict) and not key.startswith("__"):
                found += [(value, k) for k, v in list(value.items()) if v is reference]
    return found


@contextmanager
def plugged(reference, fn):
    """The package's answer `reference` replaced by `fn` wherever minidist holds it, then put back."""
    holders = _holders(reference)
    if not holders:
        raise RuntimeError(f"the grader found no module holding {reference.__qualname__}")
    for space, key in holders:
        space[key] = fn
    try:
        yield
    finally:
        for space, key in holders:
            space[key] = reference


def lesson_module(lesson):
    return importlib.import_module(f"minidist.lessons.{lesson}")


class PluginSession:
    """What the referee needs of a check's session, for a plug-in check: a duplicate of the
    world to run on, and where the thread is when time runs out. Nothing to cancel: the
    package's own communication blocks inside MPI."""

    def __init__(self, world):
        self.comm = world.Dup()
        self.doing = "starting"
        self.thread = None
        self.sub = None

    def where(self):
        wait = ""
        marks = sys.modules.get("minidist.comm.watchdog")
        if marks is not None and self.thread is not None:
            mark = marks._marks.get(self.thread)
            if mark:
                wait = f", waiting in {mark[1]}"
        return f"running {self.doing}{wait}"

    def stop(self):
        pass

    def drain(self):
        pass

    def free(self):
        self.comm.Free()


def _one(run, dtype, ex, fn, world, session, together=()):
    """Run the lesson once with fn plugged in; raise AssertionError unless it matches.

    A crash raises at once on the rank that crashed (the others are then blocked in the
    lesson's communication: the referee times them out). A lesson that ends, matching or
    not, is agreed by every rank of the world (those that sat out too) before the next run,
    so that no rank starts the next run while another has stopped: rank 0 says why it
    mismatched, the others stop quietly.
    """
    from minidist.grader.counting import Stopped
    from minidist.lessons import harness
    k = run.ranks or world.Get_size()
    rank = world.Get_rank()
    if k > world.Get_size():
        raise AssertionError(f"the plug-in check runs lesson {run.lesson[:2]} on {k} ranks, graded on "
                             f"{world.Get_size()}: grade with mpirun -n {k} (or more)")
    if run.ranks:                          # the first k ranks run the lesson; the others sit out
        part = world.Split(0 if rank < k else 1, rank)
        comm = part if rank < k else None
    else:
        part, comm = None, world
    names = " and ".join(e.name for e, _ in together) + " together" if together else ex.name
    setting = f"lesson {run.lesson[:2]} with your {names} ({run.command(k, dtype)})"
    session.doing = setting
    matched, why = True, ""
    if comm is not None:
        mod = lesson_module(run.lesson)
        args = mod.build_parser().parse_args(run.flags(k, dtype))
        with contextlib.ExitStack() as stack:
            for e, f in together or [(ex, fn)]:
                stack.enter_context(plugged(e.reference, f))
            said_by_lesson = stack.enter_context(harness.running(comm))
            try:
                mod.main(args)
            except harness.InputError as e:    # the grader's own setting does not fit: its bug
                raise RuntimeError(f"the grader's setting {setting} is refused: {e}") from None
            except Exception as e:             # the student's code (or what it broke) raised
                raise AssertionError(f"{setting}: rank {rank} crashed: {said(e)}{where(e)}") from None
        report = said_by_lesson.reports[-1]
        matched = bool(run.judge(report) if run.judge is not None else report.get("match"))
        if not matched:
            why = _why(report, said_by_lesson.lines)
        elif run.figures is not None:
            why = _figures_differ(run.figures(report), _package_figures(run, dtype, k, mod, args, comm))
            matched = not why
    if part is not None:
        part.Free()
    flags = np.array([int(matched)], np.int64)
    world.Allreduce(flags.copy(), flags, op=MPI.MIN)      # every rank: did the lesson match?
    if not flags[0]:
        if rank == 0:                      # rank 0 ran the lesson and holds its lines
            raise AssertionError(f"{setting}: MISMATCH: {why} (the package's own {names} match"
                                 + ("; each of yours passed alone: read what their docstrings say they "
                                    "return and accept)" if together else "es there)"))
        raise Stopped("the lesson did not match: rank 0 says why")


_PACKAGE = {}       # (lesson, flags, ranks) -> the figures of the package's own run


def _package_figures(run, dtype, k, mod, args, comm):
    """The figures of the lesson run with the package's own answers (run once per setting)."""
    from minidist.lessons import harness
    key = (run.lesson, tuple(run.flags(k, dtype)), k)
    if key not in _PACKAGE:
        with harness.running(comm) as said_by_lesson:
            mod.main(args)
        _PACKAGE[key] = run.figures(said_by_lesson.reports[-1])
    return _PACKAGE[key]


def _figures_differ(got, want):
    """'' when every figure equals the package's run (floats to 1e-9 relative), else why."""
    for name, w in want.items():
        g = got.get(name)
        same = g == w if not isinstance(w, float) or not isinstance(g, float) else \
            abs(g - w) <= 1e-9 * max(1.0, abs(w))
        if not same:
            return f"the lesson says MATCH, but its {name} is {g!r} where the package's own run has {w!r}"
    return ""


FLAGGED = ("DIFFER", "OUTSIDE", "NOT ", "MISMATCH", "FAIL", "WRONG")


def _why(report, lines):
    """Why the lesson said MISMATCH, in its own words: the values' difference, and every
    line of its output that flags a figure (bytes DIFFERS, NOT FREED, OUTSIDE, ...)."""
    rel, tol = report.get("max_rel_diff"), report.get("tolerance")
    parts = []
    if rel is not None and tol is not None:
        parts.append(f"max_rel_diff {rel:.2e} {'>' if not rel <= tol else 'within'} tolerance {tol:.0e}")
    flagged = [" ".join(line.split()) for line in lines
               if any(w in line for w in FLAGGED) and not line.lstrip().startswith("verdict")]
    parts += flagged[:3]
    return "; ".join(parts) or "the lesson's verdict"


def check(ex, fn, session):
    """The plug-in check of exercise `ex` with the student's `fn`: every run of ex.runs."""
    session.thread = threading.get_ident()
    wrapped = counted(fn, ex.reference.__module__)
    for run in ex.runs:
        for dtype in run.dtypes:
            _one(run, dtype, ex, wrapped, session.comm, session)
    if wrapped.calls == 0 and session.comm.Get_rank() == 0:
        raise RuntimeError(f"the grader's plug-in check of {ex.number} never called {ex.name}: "
                           "a bug in the grader, not in your file")


def shared_runs(exercises):
    """The lesson settings (in order, each once) marked `together` that the plug-in checks
    of at least two of `exercises` run: where, in the package, one of the functions hands
    its result to another (GradScaler: unscale_grads' found_inf to update_scale; 1-bit:
    onebit_compress's bytes to onebit_decompress; Checkpoint: checkpoint_forward's counters
    to checkpoint_backward). Only there can two answers that each pass beside the package's
    disagree with each other; elsewhere it would be one more lesson run for nothing."""
    runs = []
    for e in exercises:
        runs += [r for r in e.runs if r.together and r not in runs and sum(r in x.runs for x in exercises) >= 2]
    return runs


def check_together(run, exercises, fns, session):
    """The plug-in check once more: lesson setting `run`, in its first dtype, with every
    function of `exercises` (each fn beside its exercise) plugged in at once. Each function
    passed its own plug-in check with the package's answers around it; two of a student's
    that disagree on what they hand each other (a numpy.bool_ where a bool is tested with
    `is`) pass alone and fail only here."""
    session.thread = threading.get_ident()
    pairs = [(e, counted(f, e.reference.__module__)) for e, f in zip(exercises, fns)]
    _one(run, run.dtypes[0], None, None, session.comm, session, together=pairs)
