"""The grader, in one process: answers PASS, stubs are TODO, mistakes FAIL in words, usage errors
exit 2 in one line, a class is graded from a folder into one JSON. (Under mpirun: test_planted.py.)"""
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minidist.grader import command as grade, referee
from minidist.grader.checks import ex00_autograd

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "lessons" / "exercises" / "00_autograd.py"
PLANTED = ROOT / "tests" / "planted"


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minidist.grade", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def answers_file(tmp_path, module, exercises, name=STUBS.name):
    """A student file whose functions are the package's own answers."""
    f = tmp_path / name
    f.write_text("".join(f"from {module} import {e.name}\n" for e in exercises))
    return f


def test_package_answers_all_pass(tmp_path):
    f = answers_file(tmp_path, "minidist.ops", ex00_autograd.EXERCISES)
    code, lines, _ = grade.grade(str(f), out=lambda *_: None)
    assert [v for _, _, v, _ in lines] == ["PASS"] * len(ex00_autograd.EXERCISES), lines
    assert code == 0


def test_untouched_stubs_are_todo_and_exit_nonzero():
    proc = run(STUBS)
    lines = [l for l in proc.stdout.splitlines() if l.split()[:1] in (["PASS"], ["FAIL"], ["TODO"])]
    assert len(lines) == len(ex00_autograd.EXERCISES) >= 4
    assert all(l.startswith("TODO") for l in lines), proc.stdout
    assert proc.returncode == 1


def test_a_wrong_answer_fails_in_plain_words(tmp_path):
    f = tmp_path / STUBS.name
    f.write_text("from minidist.ops import gelu_backward as _g\n"
                 "def gelu_backward(*args):\n    return 2 * _g(*args)\n")
    code, lines, _ = grade.grade(str(f), only={"0.4"}, out=lambda *_: None)
    (_, _, verdict, message), = lines
    assert verdict == "FAIL" and "expected" in message and code == 1


@pytest.mark.parametrize("body, name, words", [
    ("from minidist.fused import gelu_backward as _g\n"
     "def gelu_backward(x, grad):\n    out = _g(x, grad)\n    x *= 0\n    return out\n",
     "gelu_backward", "changed its input `x` in place"),
    ("import numpy as np\n"
     "def softmax_cross_entropy_backward(probs, targets, grad):\n"
     "    probs[np.arange(len(targets)), targets] -= 1\n    probs *= grad / len(targets)\n    return probs\n",
     "softmax_cross_entropy_backward", "changed its input `probs` in place"),
])
def test_a_backward_that_changes_its_inputs_fails(tmp_path, body, name, words):
    f = tmp_path / "00_autograd.py"
    f.write_text(body)
    number = next(e.number for e in ex00_autograd.EXERCISES if e.name == name)
    code, lines, _ = grade.grade(str(f), only={number}, out=lambda *_: None)
    (_, _, verdict, message), = lines
    assert verdict == "FAIL" and words in message and code == 1, message


def test_missing_function_and_broken_file(tmp_path):
    f = tmp_path / STUBS.name
    f.write_text("x = 1\n")
    _, lines, _ = grade.grade(str(f), out=lambda *_: None)
    assert all(v == "FAIL" and "no function named" in m for _, _, v, m in lines)
    f.write_text("def broken(:\n")
    _, lines, _ = grade.grade(str(f), out=lambda *_: None)
    assert all(v == "FAIL" and "does not import" in m for _, _, v, m in lines)


def test_a_serial_check_that_never_finishes_is_a_fail_not_a_hang_and_no_deadlock():
    t0 = time.perf_counter()
    verdict, message, finished = referee.run_check(lambda fn: fn(), lambda: time.sleep(30), timeout=0.5)
    assert verdict == referee.FAIL and not finished and "did not finish" in message
    assert "deadlock" not in message
    assert time.perf_counter() - t0 < 5


def test_an_endless_loop_in_exercise_00_is_graded_within_its_timeout(tmp_path):
    f = tmp_path / "loops.py"
    f.write_text("def gelu_backward(x, grad):\n    while True:\n        pass\n")
    out = tmp_path / "out.json"
    proc = run("--exercise", "00", "--only", "0.4", "--timeout", "1", "--json", out, f)
    (row,) = json.loads(out.read_text())["results"]
    assert row["verdict"] == "FAIL" and "did not finish within 1 s" in row["message"], row
    assert "deadlock" not in proc.stdout and row["seconds"] <= 1 + 2
    assert proc.returncode == 1


def test_exceptions_name_the_students_line():
    def student():
        return [][1]
    verdict, message, _ = referee.run_check(lambda fn: fn(), student, timeout=5)
    assert verdict == referee.FAIL and message.startswith("IndexError") and "line" in message


def test_multi_rank_exercises_fail_without_mpirun():
    proc = run(PLANTED / "01_good_student.py", "--exercise", "01")
    verdicts = [l for l in proc.stdout.splitlines() if l.startswith(("PASS", "FAIL", "TODO"))]
    assert len(verdicts) == 3 and all(l.startswith("FAIL") and "needs at least 3 ranks" in l
                                      for l in verdicts), proc.stdout
    assert "mpirun -n 3" in proc.stdout and proc.returncode == 1


@pytest.mark.parametrize("args, words", [
    (["--timeout", "0", STUBS], "--timeout must be a positive"),
    (["--timeout", "-2", STUBS], "--timeout must be a positive"),
    (["--timeout", "nan", STUBS], "--timeout must be a positive"),
    ([STUBS, "--only", "9.9"], "--only 9.9: no such exercise"),
    (["--exercise", "99", STUBS], "no checks for 99"),
    (["--bogus", STUBS], "unrecognized arguments: --bogus"),
    (["--json", ROOT / "tests", STUBS], "is a folder"),
    (["--json", "/no/such/folder/out.json", STUBS], "cannot write there"),
    ([ROOT / "tests" / "nope.py"], "no such file"),
])
def test_bad_usage_is_one_line_and_exit_2(args, words):
    proc = run(*args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr, proc.stderr


def test_unknown_exercise_file_is_a_clear_error(tmp_path):
    f = tmp_path / "99_nothing.py"
    f.write_text("")
    proc = run(f)
    assert proc.returncode == 2 and "no checks for 99_nothing.py" in proc.stderr


def test_help_documents_the_exit_codes():
    proc = run("--help")
    assert proc.returncode == 0
    for words in ("exit codes", "0  every exercise", "1  some exercise", "2  bad usage", "--json", "3 ranks"):
        assert words in proc.stdout, words


def test_a_class_from_a_folder_into_one_json(tmp_path):
    folder = tmp_path / "submissions"
    folder.mkdir()
    answers_file(folder, "minidist.ops", ex00_autograd.EXERCISES, name="alice.py")
    shutil.copy(STUBS, folder / "bob.py")
    out = tmp_path / "class.json"
    proc = run("--exercise", "00", "--json", out, folder)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(l.startswith("alice.py  PASS  0.1") for l in lines), proc.stdout
    assert any(l.startswith("bob.py  TODO  0.1") for l in lines), proc.stdout
    run_ = json.loads(out.read_text())
    assert run_["exit_code"] == 1 and run_["ranks"] == 1
    rows = run_["results"]
    assert len(rows) == 2 * len(ex00_autograd.EXERCISES)
    assert set(rows[0]) == {"file", "exercise", "name", "verdict", "message", "seconds"}
    assert {(Path(r["file"]).name, r["verdict"]) for r in rows} == {("alice.py", "PASS"), ("bob.py", "TODO")}
