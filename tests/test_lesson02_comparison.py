"""Lesson 02 compares the raw gradients, so a planted constant factor fails the lesson itself.

The lesson runs under mpirun with the average divided by N-1 instead of N (patched in a
small launcher, the package untouched). With AdamW after gradient clipping the weights
barely move from the right ones; the lesson must still say MISMATCH, exit 1, point at
the raw gradients and name the factor N/(N-1).
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

pytestmark = needs_mpirun

LAUNCHER = textwrap.dedent("""
    import importlib, sys
    from minidist.comm import all_reduce
    from minidist.lessons import harness
    from minidist.parallel import data_parallel

    def average_divided_by_n_minus_1(comm, grads):
        return [all_reduce(comm, g, op="sum") / (comm.Get_size() - 1) for g in grads]

    data_parallel.average_gradients = average_divided_by_n_minus_1
    lesson = importlib.import_module("minidist.lessons.02_data_parallel")
    sys.exit(harness.run(lesson.main, lesson.build_parser()))
""")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lesson_02_fails_on_an_average_over_n_minus_1(tmp_path, dtype):
    launcher = tmp_path / "planted.py"
    launcher.write_text(LAUNCHER)
    proc = subprocess.run([*mpirun_cmd(3), sys.executable, str(launcher), "--naive", "--dtype", dtype,
                           "--timing-reps", "1", "--steps", "2"], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-3000:]
    assert "the raw gradients of every step: synchronised across ranks, before clipping" in out
    raw = next(line for line in out.splitlines() if line.strip().startswith("raw gradients"))
    assert "OUTSIDE the tolerance" in raw, raw
    assert "raw gradients are 1.5 x the reference's" in out, out     # sum/2 against sum/3
    assert "verdict: MISMATCH" in out


def test_lesson_02_says_what_it_compared_when_it_matches():
    proc = subprocess.run([*mpirun_cmd(2), sys.executable, "-m", "minidist.lessons.02_data_parallel",
                           "--timing-reps", "1", "--steps", "2", "--grad-clip", "0"],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "the raw gradients of every step" in out and "no gradient clipping" in out
    raw = next(line for line in out.splitlines() if line.strip().startswith("raw gradients"))
    assert "OUTSIDE" not in raw and "x the reference's everywhere" not in out
    assert "verdict: MATCH" in out
