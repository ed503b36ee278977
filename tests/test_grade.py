"""The grader, in one process: answers PASS, stubs are TODO, mistakes FAIL in words, usage errors
exit 2 in one line, a class is graded from a folder into one JSON. (Under mpirun: test_planted.py.)"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import logging_launcher, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun
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


@needs_mpirun
def test_without_mpirun_a_multi_rank_file_is_graded_in_jobs_of_its_own(tmp_path):
    """The launcher named in MINIDIST_MPIRUN starts one job per rank count, each file alone."""
    fake, log = logging_launcher(tmp_path)
    env = dict(os.environ, MINIDIST_MPIRUN=str(fake), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "minidist.grade", "--exercise", "02", "--only", "2.2",
                           "--ranks", "3", PLANTED / "02_good_student.py"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "02_good_student.py  -n 3  PASS  2.2 assign_buckets" in proc.stdout, \
        proc.stdout + proc.stderr
    assert log.read_text().startswith("-n 3 ") and "02_good_student.py" in log.read_text()


def test_a_launcher_that_cannot_start_fails_every_row_in_words(tmp_path):
    env = dict(os.environ, MINIDIST_MPIRUN="/no/such/mpirun")
    proc = subprocess.run([sys.executable, "-m", "minidist.grade", "--exercise", "01", PLANTED / "01_good_student.py"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    rows = [" ".join(r.split()) for r in proc.stdout.replace("\n      ", " ").splitlines() if "  FAIL  " in r]
    assert proc.returncode == 1 and len(rows) == 6, proc.stdout + proc.stderr     # 3 exercises at -n 3 and 4
    assert all("could not start /no/such/mpirun" in l and "MINIDIST_MPIRUN" in l for l in rows), rows
    assert max(map(len, proc.stdout.splitlines())) <= 100, proc.stdout


def test_an_untouched_stub_is_known_by_its_body(tmp_path):
    f = tmp_path / "s.py"
    f.write_text('def a(x):\n    """Doc."""\n    raise NotImplementedError("exercise 9.1: a")\n\n'
                 'def b(x):\n    raise NotImplementedError\n\n'
                 'def c(x):\n    y = x\n    raise NotImplementedError("exercise 9.3: c")\n')
    mod = grade.load_student(f)
    assert grade.untouched(mod.a) == "exercise 9.1: a" and grade.untouched(mod.b) == "not implemented yet"
    assert grade.untouched(mod.c) is None and grade.untouched(print) is None


def test_only_takes_one_exercise_before_the_file():
    proc = run("--only", "0.4", STUBS)
    lines = [l for l in proc.stdout.splitlines() if l.split()[:1] in (["PASS"], ["FAIL"], ["TODO"])]
    assert lines == ["TODO  0.4 gelu_backward"], proc.stdout + proc.stderr


def test_a_file_that_changes_the_graders_code_is_not_graded(tmp_path, monkeypatch):
    """On import (a check's helper replaced) or while its function runs (numpy.allclose
    replaced): every exercise FAILs, naming what was changed. (monkeypatch puts both back
    for the tests that follow in this process.)"""
    import numpy as np
    monkeypatch.setattr(referee, "verdict_of", referee.verdict_of)
    monkeypatch.setattr(np, "allclose", np.allclose)
    on_import = tmp_path / "a.py"
    on_import.write_text("import minidist.grader.referee as r\nr.verdict_of = lambda *a: ('PASS', '')\n"
                         "from minidist.ops import matmul_backward\n")
    code, lines, _ = grade.grade(str(on_import), exercise="00_autograd", out=lambda *_: None)
    assert code == 1 and all(v == "FAIL" and "changed the grader's own code (minidist.grader.referee.verdict_of)"
                             in m for _, _, v, m in lines), lines
    on_call = tmp_path / "b.py"
    on_call.write_text("import numpy as np\nfrom minidist.fused import gelu_backward as _g\n"
                       "def gelu_backward(x, grad):\n    np.allclose = lambda *a, **k: True\n    return _g(x, grad)\n")
    code, lines, _ = grade.grade(str(on_call), exercise="00_autograd", only={"0.4"}, out=lambda *_: None)
    assert code == 1 and "changed the grader's own code (numpy.allclose)" in lines[0][3], lines


def test_the_source_scan_flags_what_a_teacher_should_read():
    from minidist.grader.integrity import scan
    assert scan("import numpy as np\ndef f(comm, x):\n    return x\n") == []
    notes = scan("import sys\nfrom mpi4py import MPI\nimport minidist.grader.checks.ex03_tensor_parallel\n"
                 "def f(comm, x):\n    w = MPI.COMM_WORLD\n    return sys._getframe(1).f_locals['want']\n")
    assert any("imports the grader" in n for n in notes) and any("COMM_WORLD" in n for n in notes)
    assert any("_getframe" in n for n in notes) and any("f_locals" in n for n in notes), notes


def test_every_exercise_has_a_plug_in_check():
    """Acceptance: every exercise of every lesson (those added later too) runs its lesson with
    the student's function plugged in. That each run reaches the function is shown by the
    planted good students, which PASS only when it does (plugin.check raises otherwise)."""
    for exercise in grade.known_exercises().values():
        for ex in grade.checks_for(exercise):
            assert ex.runs, f"exercise {ex.number} ({exercise}) has no plug-in check"
            for run_ in ex.runs:
                assert (ROOT / "minidist" / "lessons" / f"{run_.lesson}.py").exists(), run_


def test_a_wrong_answer_that_only_the_plug_in_check_catches(tmp_path):
    """A gelu_backward that is right when the grader's unit check calls it and wrong when the
    package does: the unit check alone PASSes it, lesson 00 with it plugged in does not."""
    f = tmp_path / "00_autograd.py"
    f.write_text("import sys\nfrom minidist.fused import gelu_backward as _g\n"
                 "def gelu_backward(x, grad):\n"
                 "    caller = sys._getframe(1).f_globals.get('__name__', '')\n"
                 "    return _g(x, grad) * (1.0 if caller.startswith('minidist.grader') else 1.01)\n")
    unit_only = grade.Grader(timeout=60, out=lambda *_: None, plugins=False)
    assert [r["verdict"] for r in unit_only.grade(str(f), "00_autograd", {"0.4"})] == ["PASS"]
    (row,) = grade.Grader(timeout=60, out=lambda *_: None).grade(str(f), "00_autograd", {"0.4"})
    assert row["verdict"] == "FAIL" and row["message"].startswith("lesson 00 with your gelu_backward"), row


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
    """Without mpirun, several files of a one-process exercise: each graded in a process of its own."""
    folder = tmp_path / "submissions"
    folder.mkdir()
    answers_file(folder, "minidist.ops", ex00_autograd.EXERCISES, name="alice.py")
    shutil.copy(STUBS, folder / "bob.py")
    (folder / "carol.py").write_text("import sys\ndef gelu_backward(x, grad):\n    return sys._getframe(1)\n")
    out = tmp_path / "class.json"
    proc = run("--exercise", "00", "--json", out, folder, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(l.startswith("alice.py  -n 1  PASS  0.1") for l in lines), proc.stdout
    assert any(l.startswith("bob.py  -n 1  TODO  0.1") for l in lines), proc.stdout
    assert any(l.startswith("carol.py  0/4 pass  NOTE: inspects frames") for l in lines), proc.stdout
    run_ = json.loads(out.read_text())
    assert run_["exit_code"] == 1 and run_["ranks"] == [1]
    rows = run_["results"]
    assert len(rows) == 3 * len(ex00_autograd.EXERCISES)
    assert set(rows[0]) == {"file", "exercise", "name", "verdict", "message", "seconds", "ranks"}
    assert {(Path(r["file"]).name, r["verdict"]) for r in rows} == {
        ("alice.py", "PASS"), ("bob.py", "TODO"), ("carol.py", "FAIL")}
    files = {Path(f["file"]).name: f for f in run_["files"]}
    assert files["alice.py"]["passed"] == 4 and files["carol.py"]["notes"], files


def test_an_endless_loop_fails_its_exercise_only_and_the_class_table(tmp_path):
    """A loop that never ends (and swallows what stops it) FAILs its exercise after --timeout;
    the next exercise is still graded, an untouched stub stays TODO, a function taken from
    the package is noted; the JSON's summary and --csv hold the student x exercise table."""
    f = tmp_path / STUBS.name
    stubs = STUBS.read_text()
    f.write_text("from minidist.ops import layer_norm_backward  # noqa: F401\n\n\n"
                 "def matmul_backward(*args):\n    while True:\n        try:\n            pass\n"
                 "        except BaseException:\n            pass\n\n\n"
                 + stubs[stubs.index("def softmax_cross_entropy_backward"):])
    code = grade.main(["--timeout", "1", "--json", str(tmp_path / "o.json"), "--csv", str(tmp_path / "o.csv"),
                       str(f)])
    run_ = json.loads((tmp_path / "o.json").read_text())
    got = {r["exercise"]: (r["verdict"], r["message"]) for r in run_["results"]}
    assert [v for v, _ in got.values()] == ["FAIL", "PASS", "TODO", "TODO"], got
    assert "did not finish within 1 s" in got["0.1"][1] and code == 1
    assert run_["summary"] == [dict(file=str(f), verdicts={"0.1": "FAIL", "0.2": "PASS", "0.3": "TODO",
                                                           "0.4": "TODO"}, passed=1, total=4)]
    assert (tmp_path / "o.csv").read_text().splitlines() == [
        "file,0.1,0.2,0.3,0.4,passed,total", f"{f},FAIL,PASS,TODO,TODO,1,4"]


def test_the_packages_answer_imported_is_noted():
    from minidist.grader.integrity import scan
    notes = scan("from minidist.ops import gelu_backward\nimport minidist.ops as o\n"
                 "def matmul_backward(*a):\n    return o.matmul_backward(*a)\n", ex00_autograd.EXERCISES)
    assert notes == ["imports the package's answer gelu_backward (from minidist.ops)",
                     "uses the package's answer matmul_backward (o.matmul_backward)"], notes
    assert scan("from minidist.comm import ring_all_reduce\n", ex00_autograd.EXERCISES) == []


def test_serial_exercises_start_no_mpi_job():
    """9.1 alone is graded in this process; lesson 10's serial four in one plain Python job;
    only 10.5 at 3 and 4 ranks goes to the launcher (here one that cannot start)."""
    env = dict(os.environ, MINIDIST_MPIRUN="/no/such/mpirun", OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "minidist.grade", "--only", "9.1", "--",
                          ROOT / "lessons" / "exercises" / "09_moe.py"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert one.stdout.splitlines()[0] == "TODO  9.1 route", one.stdout + one.stderr
    ten = subprocess.run([sys.executable, "-m", "minidist.grade", ROOT / "lessons" / "exercises" /
                          "10_precision_and_compression.py"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    rows = [line.split("  ")[1:4] for line in ten.stdout.splitlines() if "  -n " in line]
    assert [r[:2] for r in rows] == [["-n 1", "TODO"]] * 4 + [["-n 3", "FAIL"], ["-n 4", "FAIL"]], ten.stdout
    assert [r[2].split()[0] for r in rows] == ["10.1", "10.2", "10.3", "10.4", "10.5", "10.5"], rows
