"""The grader: the package's own answers PASS, untouched stubs are TODO, mistakes FAIL in words."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minidist import grade
from minidist.lessons.checks import ex00_autograd

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "lessons" / "exercises" / "00_autograd.py"


def answers_file(tmp_path, module, exercises):
    """A student file whose functions are the package's own answers."""
    f = tmp_path / STUBS.name
    f.write_text("".join(f"from {module} import {e.name}\n" for e in exercises))
    return f


def test_package_answers_all_pass(tmp_path):
    f = answers_file(tmp_path, "minidist.ops", ex00_autograd.EXERCISES)
    code, lines, _ = grade.grade(str(f), out=lambda *_: None)
    assert [v for _, _, v, _ in lines] == ["PASS"] * len(ex00_autograd.EXERCISES), lines
    assert code == 0


def test_untouched_stubs_are_todo_and_exit_nonzero():
    proc = subprocess.run([sys.executable, "-m", "minidist.grade", str(STUBS)], capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.split()[:1] in (["PASS"], ["FAIL"], ["TODO"])]
    assert len(lines) == len(ex00_autograd.EXERCISES) >= 4
    assert all(l.startswith("TODO") for l in lines), proc.stdout
    assert proc.returncode == 1


def test_a_wrong_answer_fails_in_plain_words(tmp_path):
    f = tmp_path / STUBS.name
    f.write_text("from minidist.ops import gelu_backward as _g\n"
                 "def gelu_backward(*args):\n    return 2 * _g(*args)\n")
    code, lines, _ = grade.grade(str(f), only={e.number for e in ex00_autograd.EXERCISES
                                               if e.name == "gelu_backward"}, out=lambda *_: None)
    (_, _, verdict, message), = lines
    assert verdict == "FAIL" and message and code == 1


def test_missing_function_and_broken_file(tmp_path):
    f = tmp_path / STUBS.name
    f.write_text("x = 1\n")
    _, lines, _ = grade.grade(str(f), out=lambda *_: None)
    assert all(v == "FAIL" and "no function named" in m for _, _, v, m in lines)
    f.write_text("def broken(:\n")
    _, lines, _ = grade.grade(str(f), out=lambda *_: None)
    assert all(v == "FAIL" and "does not import" in m for _, _, v, m in lines)


def test_a_check_that_never_finishes_is_a_fail_not_a_hang():
    t0 = time.perf_counter()
    verdict, message, finished = grade.run_check(lambda fn: fn(), lambda: time.sleep(30), timeout=0.5)
    assert verdict == grade.FAIL and not finished and "did not finish" in message
    assert time.perf_counter() - t0 < 5


def test_exceptions_name_the_students_line():
    def student():
        return [][1]
    verdict, message, _ = grade.run_check(lambda fn: fn(), student, timeout=5)
    assert verdict == grade.FAIL and message.startswith("IndexError")


def test_unknown_exercise_file_is_a_clear_error(tmp_path):
    f = tmp_path / "99_nothing.py"
    f.write_text("")
    proc = subprocess.run([sys.executable, "-m", "minidist.grade", str(f)], capture_output=True, text=True)
    assert proc.returncode != 0 and "no checks for 99_nothing.py" in proc.stderr + proc.stdout
    proc = subprocess.run([sys.executable, "-m", "minidist.grade", str(tmp_path / "nope.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_stubs_02_are_todo_under_mpirun():
    mpirun = Path(sys.executable).with_name("mpirun")
    if not mpirun.exists():
        pytest.skip("no mpirun beside this Python")
    proc = subprocess.run([str(mpirun), "-n", "2", sys.executable, "-m", "minidist.grade",
                           str(ROOT / "lessons" / "exercises" / "02_data_parallel.py")],
                          capture_output=True, text=True, timeout=120)
    verdicts = [l.split()[0] for l in proc.stdout.splitlines() if l[:4] in ("PASS", "FAIL", "TODO")]
    assert verdicts == ["TODO", "TODO"], proc.stdout + proc.stderr
    assert proc.returncode != 0


def test_a_wrong_answer_on_one_rank_is_named_not_taken_for_a_deadlock(tmp_path):
    mpirun = Path(sys.executable).with_name("mpirun")
    if not mpirun.exists():
        pytest.skip("no mpirun beside this Python")
    f = tmp_path / "02_data_parallel.py"
    f.write_text("from minidist.parallel.data_parallel import average_gradients as _avg, assign_buckets\n"
                 "def average_gradients(comm, grads):\n"
                 "    out = _avg(comm, grads)\n"
                 "    if comm.Get_rank() == 1:\n"
                 "        out[0] = out[0] + 100\n"
                 "    return out\n")
    proc = subprocess.run([str(mpirun), "-n", "3", sys.executable, "-m", "minidist.grade", str(f), "--timeout", "20"],
                          capture_output=True, text=True, timeout=120)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("FAIL  2.1") and "rank 1: gradient 0" in first, proc.stdout + proc.stderr
    assert "PASS  2.2" in proc.stdout and proc.returncode == 1
