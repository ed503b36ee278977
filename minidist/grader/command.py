"""Grade exercise files: one student's, or a whole class's.

Over 400 lines but one idea: the command's path from a file name to its verdicts (which
files and exercises, the two passes, the lines, --json and --csv), read top to bottom; what
a check does lives in checks/, referee.py and plugin.py.

    python -m minidist.grade lessons/exercises/00_autograd.py
    python -m minidist.grade lessons/exercises/01_collectives.py          (launches mpirun -n 3, -n 4)
    python -m minidist.grade lessons/exercises/09_moe.py --only 9.1       (this process, no MPI job)
    mpirun -n 4 python -m minidist.grade lessons/exercises/01_collectives.py
    python -m minidist.grade --exercise 04 --ranks 3,4 submissions/ --json out.json --csv out.csv

Imports each student file as a module and runs the lesson's checks on its functions
(minidist/grader/checks/exNN_topic.py), one line per exercise:
  PASS  the function agrees with the unit check, and the lesson still matches one
        process with the function plugged into the package (the plug-in check:
        minidist/grader/plugin.py), in float64 and float32;
  FAIL  the first mismatch, in plain words (or the exception it raised, and the line);
        also when a lesson run where one exercise's result is another's input (08's
        counters, 10's found_inf and 1-bit bytes) fails with both of the file's functions
        plugged in at once, though each passed beside the package's answers;
  TODO  the stub still raises NotImplementedError.
A serial check still running at --timeout (an endless loop) is stopped there (referee.
interrupt) and FAILs; the file's other exercises are still graded. A file that takes an
exercise's answer from the package gets a NOTE: a teacher should read it.
Which checks apply comes from --exercise, or else from the file's name (01_collectives.py).

Where it runs. Under mpirun, this job grades the files named, one after another, on
every rank. Without mpirun, each file is graded in jobs of its own, one per rank count:
every exercise at --ranks, or each at its own (3 and 4 for the multi-rank exercises, 4
for 07, one process for the serial ones: 00, 08, 9.1, 10.1 to 10.4), started with
MINIDIST_MPIRUN or the mpirun beside this Python (minidist/grader/classroom.py): nothing
one submission does reaches another's verdict. A single file whose exercises (those
--only names) are all serial is graded here, in this process.

Multi-rank exercises need at least 3 ranks (--help lists them, each with its reason);
below that they FAIL and say so.

Under mpirun every rank runs every check, each in a thread, while the main threads talk
on their own duplicate of COMM_WORLD, non-blocking: each rank announces its verdict the
moment its check ends. A rank whose check is still running when another rank reports a
failure stops waiting at once, so an exception on one rank is agreed in a moment, not
after the time limit, and the message names the rank and the line. A check still
running after --timeout seconds is a time-out, and the message names the ranks that did
not finish and what each was waiting for. Stopped checks are freed (the student's
communicator cancels their receives and every rank drops what was sent to it:
minidist/grader/counting.py), so the next check and MPI's own exit run normally.
FAIL beats a time-out (usually its consequence), which beats TODO, which beats PASS;
among failures one that names its own cause (a refused call, a wrong-sized message) wins,
then the earliest (rank 1's wrong chunk, not rank 0's sum computed from it). That part,
the referee of one check on every rank, lives in minidist/grader/referee.py.
"""
import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path

from minidist.failfast import agreed_exit
from minidist.grader.listing import IN_JOB, checks_for, exercise_ranks, fold, known_exercises
from minidist.grader.referee import (FAIL, PASS, S_FAIL, S_TODO, TODO, release, run_check, settle, start_check,
                                     verdict_of, where, word)

EPILOG = """ranks:
{ranks}

exit codes:
  0  every exercise of every file passes
  1  some exercise fails or is still TODO
  2  bad usage: an unknown flag, file, exercise or --only number, --timeout <= 0, --ranks
     under mpirun, a --json or --csv path that cannot be written (one line, before anything
     is graded)

--json PATH writes the whole run: {{"ranks", "timeout", "exit_code", "results": [{{"file",
"exercise", "name", "verdict", "message", "seconds"[, "ranks"]}}, ...][, "files": [{{"file",
"passed", "total", "notes"}}, ...]], "summary": [{{"file", "verdicts": {{"N.M": verdict}},
"passed", "total"}}, ...]}}, one result per file, exercise (and rank count); the summary
is student x exercise, an exercise's worst verdict over its rank counts. --csv PATH writes
that summary as a table.
"""


class UsageError(Exception):
    """Bad usage, found the same on every rank: one line, exit 2."""


# ----------------------------------------------------------------------------- files and checks

def exercise_of(text):
    """'01', '1', '01_collectives' or '.../01_collectives.py' -> '01_collectives' (or UsageError)."""
    known = known_exercises()
    stem = Path(text).stem
    if stem.isdigit() and stem.zfill(2) in known:
        return known[stem.zfill(2)]
    if stem in known.values():
        return stem
    raise UsageError(f"no checks for {Path(text).name}: name the exercise with --exercise NN, or name the "
                     f"file after it; exercises are: {', '.join(known.values())}")


def default_ranks(exercise, only=None):
    """The rank counts to grade an exercise file at: every count one of its exercises (those
    in `only`, when given) is graded at."""
    exercises = checks_for(exercise)
    return tuple(sorted({n for e in exercises if only is None or e.number in only
                         for n in exercise_ranks(e, exercises)}))


def ranks_text():
    """For --help: the multi-rank exercises, their reasons, and the default rank counts."""
    lines, reasons = [], {}
    for exercise in known_exercises().values():
        for e in checks_for(exercise):
            if e.min_ranks > 1:
                reasons.setdefault((e.min_ranks, e.why_ranks), []).append(e.number)
    for (n, why), numbers in reasons.items():
        lines.append(f"{', '.join(numbers)} need at least {n} ranks ({why.rstrip(';')})")
    groups = {}                 # rank counts -> exercise files (all of a file's exercises) or numbers
    for ex in known_exercises().values():
        exercises = checks_for(ex)
        counts = {e.number: exercise_ranks(e, exercises) for e in exercises}
        if len(set(counts.values())) == 1:
            groups.setdefault(next(iter(counts.values())), []).append(ex[:2])
        else:
            for number, c in counts.items():
                groups.setdefault(c, []).append(number)
    lines.append("without mpirun each exercise is graded in jobs of its own, at its own rank counts: "
                 + "; ".join(f"{'one process' if c == (1,) else ' and '.join(map(str, c)) + ' ranks'}: "
                             f"{', '.join(names)}" for c, names in sorted(groups.items())))
    return "\n".join(textwrap.fill(line, 92, initial_indent="  ", subsequent_indent="    ") for line in lines)


def student_files(paths):
    """The .py files named, folders expanded (sorted), in order."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.glob("*.py") if f.is_file())
            if not found:
                raise UsageError(f"no .py files in folder {p}")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"no such file: {p}")
    return files


def untouched(fn):
    """The stub's text as the exercise file has it, when fn's body is still only
    `raise NotImplementedError(...)` (after its docstring); else None. Such a stub is TODO
    at any number of ranks, without being run."""
    import ast
    import inspect
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) \
        and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str) else node.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return None
    exc = body[0].exc
    call = exc.func if isinstance(exc, ast.Call) else exc
    if not (isinstance(call, ast.Name) and call.id == "NotImplementedError"):
        return None
    if isinstance(exc, ast.Call) and exc.args and isinstance(exc.args[0], ast.Constant):
        return str(exc.args[0].value)
    return "not implemented yet"


def load_student(path, i=0):
    """Import the file at `path` as a module, without touching sys.path."""
    spec = importlib.util.spec_from_file_location(f"student_{i}_{Path(path).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- a file, a class

def mpi_world():
    """COMM_WORLD when this is a job of several ranks (mpi4py imported only then)."""
    if not any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")):
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


class Grader:
    """Grades files one exercise at a time, every rank alike; remembers a stuck thread.

    A file is graded in two passes: every exercise's unit check, then the plug-in check
    (minidist/grader/plugin.py) of each exercise whose unit check passed. The plug-in
    checks come last because a broken answer can leave a rank blocked inside MPI, after
    which this job grades nothing more; the unit checks' verdicts are in by then.
    plugins=False grades the unit checks alone (the tests use it to show what only the
    plug-in check catches).
    """

    def __init__(self, timeout=30.0, out=print, plugins=True):
        self.timeout, self.out, self.plugins = timeout, out, plugins
        self.world = mpi_world()
        self.ctl = self.world.Dup() if self.world is not None else None
        self.n = self.world.Get_size() if self.world is not None else 1
        self.root = self.world is None or self.world.Get_rank() == 0
        self.jobs, self.stuck = 0, False
        self.snapshot = None          # the grader's code before the first student's file ran

    def _guarded(self, check):
        """check, then the grader's own code compared with the snapshot (in the check's
        thread, so that every rank's finding is agreed like any failure)."""
        snapshot = self.snapshot

        def guarded(fn, *session):
            try:
                check(fn, *session)
            finally:
                what = snapshot.changed() if snapshot is not None else None
                if what:
                    raise AssertionError(f"the file changed the grader's own code ({what}): not graded")
        return guarded

    def _agree(self, check, fn, result, session, multi, timeout):
        """Run check(fn[, session]) here (unless result already holds this rank's outcome)
        and agree with every rank: (verdict, message)."""
        check = self._guarded(check)
        if self.ctl is None:
            if result:
                return word(result["v"][0]), result["v"][1]
            verdict, message, finished = run_check(check, fn, timeout, session)
            self.stuck = self.stuck or not finished
            return verdict, message
        thread = None
        if not result:
            thread, result = start_check(check, fn, session)
        tag = (2 * self.jobs) % 30000
        self.jobs += 1
        heard = settle(self.ctl, tag, thread, result, session, timeout)
        if session is not None:
            self.stuck = release(self.ctl, tag + 1, thread, session) or self.stuck
        elif thread is not None and thread.is_alive():      # a serial check's endless loop: end it, so
            from minidist.grader.referee import interrupt   # that it stops taking the cores (every rank
            interrupt(thread)                               # runs it alike; none waits for it)
        return verdict_of(heard, timeout, multi)

    def one(self, ex, student, load_error):
        """(verdict, message) of one exercise's unit check, the same on every rank."""
        multi = ex.min_ranks > 1
        fn = getattr(student, ex.name, None)
        result, session = {}, None
        if multi and self.ctl is not None and not self.stuck:
            # made on every rank alike, whatever this rank found in the student's file below:
            # Dup is a collective, and ranks may disagree (a file that fails to import on one)
            from minidist.grader.counting import Session
            session = Session(self.world, split=ex.groups)
        if self.stuck:
            result["v"] = (S_FAIL, "not run: an earlier check did not finish")
        elif load_error:
            result["v"] = (S_FAIL, load_error)
        elif not callable(fn):
            result["v"] = (S_FAIL, f"the file has no function named {ex.name}")
        elif (stub := untouched(fn)) is not None:
            result["v"] = (S_TODO, stub)
        elif self.n < ex.min_ranks:
            result["v"] = (S_FAIL, f"needs at least {ex.min_ranks} ranks, graded on {self.n}: "
                           f"{ex.why_ranks} grade with mpirun -n {ex.min_ranks} and -n {ex.min_ranks + 1}")
        return self._agree(ex.check, fn, result, session, multi, self.timeout)

    def plugin(self, ex, student):
        """(verdict, message) of one exercise's plug-in check, the same on every rank."""
        from mpi4py import MPI
        from minidist.grader import plugin
        if self.stuck:
            return FAIL, "not run: an earlier check did not finish"
        session = plugin.PluginSession(self.world if self.world is not None else MPI.COMM_SELF)
        limit = plugin.time_limit(ex, self.timeout)
        verdict, message = self._agree(lambda f, s: plugin.check(ex, f, s), getattr(student, ex.name),
                                       {}, session, self.n > 1, limit)
        if verdict == FAIL and "did not finish within" in message:
            message = f"{message} (the plug-in check: your {ex.name} in the package, the lesson run on it)"
        return verdict, message

    def together(self, passed, student):
        """The plug-in check once more with every passing function of the file plugged in at
        once (each lesson setting in its first dtype): two answers that each pass beside the
        package's others may disagree with each other. A mismatch FAILs the exercises whose
        own plug-in check runs that setting."""
        from mpi4py import MPI
        from minidist.grader import plugin
        exercises = [ex for ex, _ in passed]
        fns = [getattr(student, ex.name) for ex in exercises]
        for run in plugin.shared_runs(exercises):
            if self.stuck:
                return
            t0 = time.perf_counter()
            session = plugin.PluginSession(self.world if self.world is not None else MPI.COMM_SELF)
            verdict, message = self._agree(lambda f, s, run=run: plugin.check_together(run, exercises, fns, s),
                                           None, {}, session, self.n > 1, max(self.timeout, plugin.LESSON_RUN_S))
            if verdict == PASS:
                continue
            for ex, row in passed:
                if run in ex.runs and row["verdict"] == PASS:
                    row["verdict"], row["message"] = FAIL, message
                    row["seconds"] = round(row["seconds"] + time.perf_counter() - t0, 3)

    def grade(self, path, exercise, only=None, i=0, prefix=""):
        """Grade one file; returns [row dicts]."""
        from minidist.grader.integrity import Snapshot
        exercises = [e for e in checks_for(exercise) if only is None or e.number in only]
        if self.snapshot is None:
            from minidist.grader.plugin import lesson_module
            for run in {r.lesson for e in exercises for r in e.runs}:
                lesson_module(run)        # imported now, so that the snapshot holds them too
            self.snapshot = Snapshot()
        before = self.snapshot.changed()
        try:
            student, load_error = load_student(path, i), None
        except Exception as e:
            student, load_error = None, f"the file does not import: {type(e).__name__}: {e}{where(e)}"
        changed = self.snapshot.changed()
        if before:
            load_error = (f"not graded: an earlier file in this job changed the grader's own code ({before}); "
                          "grade each file in a job of its own (python -m minidist.grade --ranks ...)")
        elif changed:
            load_error = f"the file changed the grader's own code ({changed}) when imported: not graded"
        rows = []
        for ex in exercises:
            t0 = time.perf_counter()
            verdict, message = self.one(ex, student, load_error)
            rows.append(dict(file=str(path), exercise=ex.number, name=ex.name, verdict=verdict,
                             message=message, seconds=round(time.perf_counter() - t0, 3)))
        for ex, row in zip(exercises, rows):
            if self.plugins and ex.runs and row["verdict"] == PASS:
                t0 = time.perf_counter()
                row["verdict"], row["message"] = self.plugin(ex, student)
                row["seconds"] = round(row["seconds"] + time.perf_counter() - t0, 3)
        if self.plugins:
            self.together([(ex, row) for ex, row in zip(exercises, rows) if ex.runs and row["verdict"] == PASS],
                          student)
        if self.root:
            for row in rows:
                tail = f": {row['message']}" if row["message"] and row["verdict"] != PASS else ""
                if row["verdict"] == TODO and row["message"].startswith("exercise "):
                    tail = ""          # the stub's own words repeat the number and the name
                self.out(fold(f"{prefix}{row['verdict']}  {row['exercise']} {row['name']}{tail}"))
            n_pass = sum(r["verdict"] == PASS for r in rows)
            self.out(f"{prefix}{n_pass}/{len(rows)} exercises pass")
            from minidist.grader.integrity import scan
            notes = scan(Path(path).read_text(errors="replace"), exercises)
            if notes and not os.environ.get(IN_JOB):    # (a class's notes: classroom prints them)
                self.out(fold(f"{prefix}NOTE: {'; '.join(notes)}: read it"))
        return rows


def grade(path, timeout=30.0, only=None, out=print, exercise=None):
    """Grade the file at `path` (exercise from its name unless given).

    Returns (exit code, [(number, name, verdict, message)], stuck): stuck says a check's
    thread is still blocked, so MPI cannot finish normally.
    """
    g = Grader(timeout, out)
    rows = g.grade(path, exercise or exercise_of(path), only)
    code = 0 if all(r["verdict"] == PASS for r in rows) else 1
    return code, [(r["exercise"], r["name"], r["verdict"], r["message"]) for r in rows], g.stuck


# ----------------------------------------------------------------------------- the command line

def _rank0():
    """Rank 0 of the job (or no job): read from the environment, before MPI starts."""
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if key in os.environ:
            return os.environ[key] == "0"
    return True


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def rank_counts(text):
    """argparse type: '3,4' -> (3, 4)."""
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rank counts such as 3,4, got {text!r}")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"rank counts are at least 1, got {text!r}")
    return counts


def parse(argv):
    """The arguments, checked: (args, [(file, exercise)], only). Raises UsageError."""
    p = _Parser(prog="python -m minidist.grade", description=__doc__.split("\n\n")[0],
                epilog=EPILOG.format(ranks=ranks_text()), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="exercise files or folders of them (a folder: its *.py files)")
    p.add_argument("--exercise", metavar="NN", help="which checks, e.g. 01 (default: from each file's name)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds one check, or one lesson run of a plug-in check, may take (default %(default)s)")
    p.add_argument("--only", action="append", nargs="+", metavar="N.M",
                   help="grade only these exercises, e.g. --only 1.2, --only 4.2 4.3 or --only 4.2,4.3")
    p.add_argument("--ranks", type=rank_counts, metavar="R[,R]",
                   help="without mpirun: grade each file in jobs of its own at these rank counts, e.g. 3,4 "
                        "(default: the exercise's own)")
    p.add_argument("--json", metavar="PATH", help="also write the whole run to PATH as JSON")
    p.add_argument("--csv", metavar="PATH", help="also write a table to PATH: a row per file, a column per "
                                                 "exercise (its verdict), passed, total")
    args = p.parse_args(argv)
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    if args.ranks and mpi_world() is not None:
        raise UsageError("--ranks starts its own jobs: run it without mpirun")
    # --only takes one or more numbers, so a file named right after them lands there: give it back
    words = [w for item in (args.only or []) for w in item]
    named = [w for w in words if w.endswith(".py") or os.path.sep in w or os.path.exists(w)]
    files = student_files([*named, *args.files]) if named or args.files else None
    if not files:
        raise UsageError("name at least one exercise file or folder")
    jobs = [(f, exercise_of(args.exercise or f)) for f in files]
    only = {n for w in words if w not in named for n in w.split(",") if n} or None
    if only:
        numbers = {e.number for _, ex in jobs for e in checks_for(ex)}
        unknown = sorted(only - numbers)
        if unknown:
            raise UsageError(f"--only {' '.join(unknown)}: no such exercise; these files have "
                             f"{', '.join(sorted(numbers))}")
    for flag, name in (("--json", args.json), ("--csv", args.csv)):
        if not name:
            continue
        out = Path(name)
        if out.is_dir():
            raise UsageError(f"{flag} {out}: is a folder; name a file")
        if not out.parent.resolve().is_dir() or not os.access(out.parent.resolve(), os.W_OK) \
                or (out.exists() and not os.access(out, os.W_OK)):
            raise UsageError(f"{flag} {out}: cannot write there")
    return args, jobs, only


def in_separate_jobs(args, jobs, only=None):
    """The rank counts to grade each file at in jobs of its own, or None to grade here:
    under mpirun, inside such a job, or one file whose exercises (those --only names) are
    all graded in one process."""
    if mpi_world() is not None or os.environ.get(IN_JOB):
        return None
    if args.ranks:
        return args.ranks
    counts = sorted({n for _, ex in jobs for n in default_ranks(ex, only)})
    if counts == [1] and len(jobs) == 1:
        return None
    return tuple(counts)


def write_json(path, **run):
    Path(path).write_text(json.dumps(run, indent=1) + "\n")


def summary(rows):
    """Student x exercise: one entry per file, {"file", "verdicts": {exercise: verdict},
    "passed", "total"}; an exercise graded at several rank counts has its worst verdict
    (FAIL, then TODO, then PASS)."""
    worst = {PASS: 0, TODO: 1, FAIL: 2}
    table = {}
    for r in rows:
        cells = table.setdefault(r["file"], {})
        if worst[r["verdict"]] >= worst.get(cells.get(r["exercise"]), -1):
            cells[r["exercise"]] = r["verdict"]
    return [dict(file=f, verdicts=cells, passed=sum(v == PASS for v in cells.values()), total=len(cells))
            for f, cells in table.items()]


def write_csv(path, table):
    """The summary as CSV: file, one column per exercise (its verdict), passed, total."""
    import csv
    numbers = sorted({n for t in table for n in t["verdicts"]}, key=lambda n: [int(p) for p in n.split(".")])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", *numbers, "passed", "total"])
        for t in table:
            w.writerow([t["file"], *(t["verdicts"].get(n, "") for n in numbers), t["passed"], t["total"]])


def main(argv=None):
    try:
        args, jobs, only = parse(argv)
    except UsageError as e:   # every rank parsed the same arguments: every rank exits alike
        if _rank0():
            print(f"python -m minidist.grade: error: {e} (see --help)", file=sys.stderr)
        return 2
    counts = in_separate_jobs(args, jobs, only)
    if counts is not None:
        from minidist.grader.classroom import grade_class
        rows, files = grade_class(jobs, counts, args.timeout, only, own_ranks=not args.ranks)
        code = 0 if all(r["verdict"] == PASS for r in rows) else 1
        if args.json:
            write_json(args.json, ranks=list(counts), timeout=args.timeout, exit_code=code, results=rows,
                       files=files, summary=summary(rows))
        if args.csv:
            write_csv(args.csv, summary(rows))
        return code
    g = Grader(args.timeout)
    rows = []
    for i, (path, exercise) in enumerate(jobs):
        prefix = f"{path.name}  " if len(jobs) > 1 else ""
        rows += g.grade(path, exercise, only, i, prefix)
    code = 0 if all(r["verdict"] == PASS for r in rows) else 1
    if args.json and g.root:
        write_json(args.json, ranks=g.n, timeout=args.timeout, exit_code=code, results=rows, summary=summary(rows))
    if args.csv and g.root:
        write_csv(args.csv, summary(rows))
    sys.stdout.flush()
    if g.stuck:  # a thread is blocked inside MPI for good: MPI_Finalize would wait for it
        if g.ctl is not None:
            g.ctl.Barrier()
        os._exit(code)
    return code


if __name__ == "__main__":
    agreed_exit(main())  # the verdicts and usage errors are agreed: every rank exits alike
