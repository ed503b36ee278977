"""The teacher's form: every file graded in fresh jobs of its own, one per rank count.

    python -m minidist.grade --exercise 04 --ranks 3,4 submissions/ --json out.json

Inside one job, files are graded one after another in the same processes, so one
submission can spoil the next: a check it left blocked in MPI stops the job's later
checks ("not run"), a function it left plugged into the package or a helper of the
grader it replaced changes what the next file is graded against. Here nothing one file
does reaches another's verdict: for each file and each rank count this module starts

    MPIRUN -n R python -m minidist.grade --exercise 04 --json JOB.json FILE

(or plain `python -m minidist.grade ...` for R = 1), reads that job's JSON, and kills the
job if it outlives its time (every check's time-out, plus a margin). The launcher is
MINIDIST_MPIRUN if set (words split as a shell would: `mpirun --oversubscribe`), else
the mpirun beside this Python, else the one on PATH.

Each file's source is also scanned (integrity.scan) and what a teacher should read is
printed beside its verdicts: a file that imports the grader, inspects stack frames or
uses MPI.COMM_WORLD passes nothing by it, but may have passed by it.
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from minidist.grader.integrity import scan
from minidist.grader.listing import IN_JOB, checks_for, exercise_ranks, fold
MARGIN_S = 60.0


def launcher():
    """The mpirun command as a list, or None when there is none."""
    named = os.environ.get("MINIDIST_MPIRUN")
    if named:
        return shlex.split(named)
    beside = Path(sys.executable).with_name("mpirun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("mpirun")
    return [found] if found else None


def job_command(ranks, path, exercise, timeout, only, out):
    grade = [sys.executable, "-m", "minidist.grade", "--exercise", exercise, "--timeout", f"{timeout:g}",
             "--json", str(out)]
    if only:
        grade += ["--only", ",".join(sorted(only))]
    grade += ["--", str(path)]
    if ranks == 1:
        return grade
    mpirun = launcher()
    if mpirun is None:
        return None
    return [*mpirun, "-n", str(ranks), *grade]


def time_limit(exercises, timeout):
    """Seconds one job may take: each unit check and each lesson run of its plug-in check."""
    from minidist.grader.plugin import LESSON_RUN_S, shared_runs, time_limit as plugin_limit
    together = max(timeout, LESSON_RUN_S) * len(shared_runs(exercises))     # all plugged in at once
    return sum(timeout + plugin_limit(ex, timeout) for ex in exercises) + together + MARGIN_S


def run_job(cmd, limit):
    """(exit code or None when killed, the job's output)."""
    env = dict(os.environ, **{IN_JOB: "1"})
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    except OSError as e:
        return -1, f"could not start {cmd[0]}: {e.strerror} (set MINIDIST_MPIRUN to your MPI's launcher)"
    try:
        out, _ = proc.communicate(timeout=limit)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def grade_one(path, exercise, exercises, ranks, timeout, only):
    """The rows of one file at one rank count, graded in a job of its own."""
    with tempfile.TemporaryDirectory(prefix="minidist-grade-") as tmp:
        out = Path(tmp) / "job.json"
        cmd = job_command(ranks, path, exercise, timeout, only, out)
        if cmd is None:
            problem = "no mpirun found: set MINIDIST_MPIRUN to your MPI's launcher"
        else:
            limit = time_limit(exercises, timeout)
            code, text = run_job(cmd, limit)
            try:
                return json.loads(out.read_text())["results"]
            except (OSError, ValueError, KeyError):
                last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
                problem = (f"the grading job did not end within {limit:g} s and was stopped" if code is None else
                           f"the grading job ended without a verdict (exit code {code}): {last[0][:300]}")
    return [dict(file=str(path), exercise=ex.number, name=ex.name, verdict="FAIL", message=problem, seconds=0.0)
            for ex in exercises]


def grade_class(jobs, rank_counts, timeout, only, out=print, own_ranks=False):
    """Grade [(path, exercise)] at each rank count, each file in jobs of its own.
    own_ranks: each exercise only at the counts it is graded at (command.exercise_ranks),
    so that a serial exercise starts one process, not an MPI job per count.

    Returns (rows, files): rows carry their "ranks"; files are per-file totals and notes.
    """
    rows, files = [], []
    for path, exercise in jobs:
        exercises = [e for e in checks_for(exercise) if only is None or e.number in only]
        notes = scan(Path(path).read_text(errors="replace"), exercises)
        mine = []
        for ranks in rank_counts:
            these = [e for e in exercises if not own_ranks or ranks in exercise_ranks(e, checks_for(exercise))]
            if not these:
                continue
            got = grade_one(path, exercise, these, ranks, timeout, {e.number for e in these})
            for row in got:
                row["ranks"] = ranks
                message = f": {row['message']}" if row["message"] and row["verdict"] == "FAIL" else ""
                out(fold(f"{Path(path).name}  -n {ranks}  {row['verdict']}  {row['exercise']} {row['name']}{message}"))
            mine += got
        passed = sum(r["verdict"] == "PASS" for r in mine)
        out(fold(f"{Path(path).name}  {passed}/{len(mine)} pass"
                 + (f"  NOTE: {'; '.join(notes)}: read it" if notes else "")))
        files.append(dict(file=str(path), passed=passed, total=len(mine), notes=notes))
        rows += mine
    return rows, files
