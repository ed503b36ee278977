"""Wrong answers students really write FAIL under mpirun, quickly and in words, never hang.

Each file in tests/planted/ plants one bug (its docstring says which) beside the package's
own answers for the other functions, which must still PASS: a stopped or deadlocked check
must not spoil the next one. The grader runs as a class would run it: one mpirun, a folder
of files, --json; every row's seconds are bounded by the check's timeout. A concrete
failure (an exception on one rank, a wrong value, a refused collective) must be agreed
well before the timeout; a deadlock may take the timeout, plus the moment to free it.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import MPIRUN, mpirun_cmd, needs_mpirun, our_lines  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ROOT / "tests" / "planted"
FREE_S = 4.0      # after a time-out: stopping the threads, draining, agreeing (GRACE_S + polls)

pytestmark = needs_mpirun

# file -> {exercise: words its FAIL message must hold}; None: must PASS. A planted file defines
# only its buggy function (the rest FAIL at once, "no function named"), except where the
# package's answers must PASS after a deadlock: the threads it left blocked were freed.
MISSING = "the file has no function named"
CONCRETE_01 = {
    "01_good_student.py": {"1.1": None, "1.2": None, "1.3": None},
    "01_calls_allreduce.py": {"1.3": "called comm.Allreduce: use Send/Recv/Sendrecv: this exercise builds"},
    "01_chunk_off_by_one.py": {"1.1": "at step 0, rank 1 received 3 elements from rank 0 where the ring sends 2"},
    "01_chunk_off_by_one_irecv.py": {"1.2": "rank 1 received a message longer than its receive buffer"},
    "01_extra_step.py": {"1.2": "one ring step too many"},
    "01_in_place.py": {"1.3": "changed its input"},
    "01_hard_coded_n.py": {"1.1": "after passing on all 3 ranks: MPI error: a rank outside the communicator"},
    "01_widens_dtype.py": {"1.3": "got dtype float64, expected float32"},
    "01_raises_on_rank1.py": {"1.2": "rank 1: IndexError: list index out of range (at line 10 of "
                                     "01_raises_on_rank1.py: return lengths[3])"},
}
DEADLOCKS_01 = {
    "01_send_before_recv.py": {"1.1": "rank 0 waiting in Send to rank 1", "1.2": None, "1.3": None},
    "01_wrong_neighbour.py": {"1.1": "receiving from rank 1 at step 0"},
    "01_waitall_wrong_source.py": {"1.2": "waiting with the Irecv from rank 1 of step 0 not received", "1.3": None},
}
ALL_02 = {
    "02_good_student.py": {"2.1": None, "2.2": None},
    "02_no_divide.py": {"2.1": "did you divide by N?", "2.2": "got [[3], [2, 1, 0]]"},
    "02_divide_in_place.py": {"2.1": "input gradient 0 was changed", "2.2": "got [[0, 1], [2, 3]]"},
    "02_mpi_allreduce.py": {"2.1": "called comm.Allreduce: use ring_all_reduce", "2.2": "expected [[3], [2, 1], [0]]"},
    "02_hard_coded_n.py": {"2.1": "rank 2: gradient 0", "2.2": "did not finish within"},
}

GOOD_03 = {f"3.{i}": None for i in range(1, 12)}
ALL_03 = {
    "03_good_student.py": GOOD_03,
    "03_g_backward_reduces.py": {"3.2": "this rank's part only: f's backward sums the parts",
                                 "3.4": "the sum over ranks: g's backward is the identity"},
    "03_row_bias_every_rank.py": {"3.7": "ranks disagree on the input", "3.8": "the bias counted 4 times"},
    "03_split_wrong.py": {"3.5": "got shape (3, 9), expected (6, 5); a column-parallel weight (in, out) is cut along "
                                 "axis 1", "3.11": "vocab-parallel loss backward for rank"},
    "03_split_even_only.py": {"3.5": "got shape (6, 4), expected (6, 5)"},
    "03_split_neighbour.py": {"3.5": "(that is rank 1's piece)"},
    "03_local_max.py": {"3.10": "the loss of the vocab-parallel loss"},
    "03_gathers_logits.py": {"3.10": "is the size of the whole logits"},
    "03_in_place.py": {"3.10": "changed its input number 1 (an in-place write)"},
}


def grade(ranks, files, exercise, timeout, tmp_path, *extra):
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*mpirun_cmd(ranks), sys.executable, "-m", "minidist.grade",
                           "--exercise", exercise, "--timeout", str(timeout), "--json", str(out), *extra,
                           *map(str, files)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def plugin_limit(number, timeout):
    """The seconds the exercise's plug-in check may take (its lesson runs)."""
    from minidist.grader.command import checks_for, known_exercises
    from minidist.grader.plugin import time_limit
    ex = next(e for e in checks_for(known_exercises()[number.split(".")[0].zfill(2)]) if e.number == number)
    return time_limit(ex, timeout)


def assert_rows(proc, run, expected, timeout, deadlock):
    text = proc.stdout + proc.stderr
    assert run is not None, text
    assert "BAD TERMINATION" not in text and "aborting" not in text, text
    assert proc.returncode == run["exit_code"] == (0 if not any(expected.values()) else 1), text
    seen = set()
    for row in run["results"]:
        name = Path(row["file"]).name
        want = expected[name].get(row["exercise"], MISSING)
        seen.add(name)
        assert row["seconds"] <= timeout + plugin_limit(row["exercise"], timeout) + FREE_S, row
        if want is None:
            assert row["verdict"] == "PASS", row
            continue
        assert row["verdict"] == "FAIL" and want in row["message"], row
        if not (deadlock and "did not finish" in want):     # concrete: agreed at once, not after the limit
            assert "did not finish" not in row["message"] and row["seconds"] < timeout, row
    assert seen == set(expected)


def test_planted_01_concrete_bugs_fail_at_once(tmp_path):
    timeout = 30
    proc, run = grade(3, [PLANTED / f for f in CONCRETE_01], "01", timeout, tmp_path)
    assert_rows(proc, run, CONCRETE_01, timeout, deadlock=False)


def test_planted_01_deadlocks_fail_within_the_timeout_naming_every_rank(tmp_path):
    timeout = 3
    expected = {f: {k: v and "did not finish" for k, v in d.items()} for f, d in DEADLOCKS_01.items()}
    proc, run = grade(3, [PLANTED / f for f in DEADLOCKS_01], "01", timeout, tmp_path)
    assert_rows(proc, run, expected, timeout, deadlock=True)
    for row in run["results"]:
        want = DEADLOCKS_01[Path(row["file"]).name].get(row["exercise"])
        if want:
            assert want in row["message"] and "ranks 0, 1, 2 of 3 did not finish" in row["message"], row
            assert "deadlock?" in row["message"], row


def test_planted_02_bugs_fail(tmp_path):
    timeout = 6
    proc, run = grade(3, [PLANTED / f for f in ALL_02], "02", timeout, tmp_path)
    assert_rows(proc, run, ALL_02, timeout, deadlock=True)
    loop = next(r for r in run["results"] if r["file"].endswith("02_hard_coded_n.py") and r["exercise"] == "2.2")
    assert "deadlock" not in loop["message"] and "endless loop" in loop["message"], loop


def test_planted_03_bugs_fail_and_the_stubs_are_todo(tmp_path):
    """At 4 ranks: a correct file PASSes, each bug students write FAILs in words, at once;
    the untouched stubs are TODO."""
    stubs = ROOT / "lessons" / "exercises" / "03_tensor_parallel.py"
    proc, run = grade(4, [stubs] + [PLANTED / f for f in ALL_03], "03", 10, tmp_path)
    rows = [r for r in run["results"] if r["file"] == str(stubs)]
    assert [r["verdict"] for r in rows] == ["TODO"] * 11, rows
    run["results"] = [r for r in run["results"] if r["file"] != str(stubs)]
    assert_rows(proc, run, ALL_03, 10, deadlock=False)


@pytest.mark.parametrize("ranks", [3, 4])
def test_a_divisor_written_into_the_code_fails_with_its_hint_at_3_and_4_ranks(tmp_path, ranks):
    """`/ 4` is the mean at -n 4 only: exercise 2.1 is also checked on groups of N-1 ranks and
    of 1; at -n 3 the world's own mean is wrong, and the message names the divisor."""
    hint = "divide by comm.Get_size(), not by a number written in the code)"
    expected = {"02_divide_by_4.py": {"2.1": hint}, "02_good_student.py": {"2.1": None}}
    proc, run = grade(ranks, [PLANTED / f for f in expected], "02", 10, tmp_path, "--only", "2.1", "--")
    assert_rows(proc, run, expected, 10, deadlock=False)
    bad = run["results"][0]["message"]     # the group of 3 (ranks 0-2) or rank 3 alone: whichever failed first
    if ranks == 4:
        assert "in a group of 3 ranks" in bad or "rank 3 alone" in bad, bad
    else:
        assert "(the sum divided by 4, not by the 3 ranks: divide by comm.Get_size()" in bad, bad


def test_a_class_of_two_at_4_ranks_into_one_json(tmp_path):
    """The acceptance: mpirun -n 4 python -m minidist.grade --exercise 01 --json out.json A.py B.py"""
    a, b = tmp_path / "A.py", tmp_path / "B.py"
    a.write_text((PLANTED / "01_good_student.py").read_text())
    b.write_text((PLANTED / "01_in_place.py").read_text())
    proc, run = grade(4, [a, b], "01", 30, tmp_path)
    assert run["ranks"] == 4 and len(run["results"]) == 6, proc.stdout + proc.stderr
    assert [(Path(r["file"]).name, r["verdict"]) for r in run["results"]] == [
        ("A.py", "PASS"), ("A.py", "PASS"), ("A.py", "PASS"), ("B.py", "FAIL"), ("B.py", "FAIL"), ("B.py", "FAIL")]
    assert "changed its input" in run["results"][-1]["message"]
    assert proc.returncode == 1 and proc.stdout.count("B.py  FAIL  1.3") == 1, proc.stdout


def test_below_3_ranks_multi_rank_exercises_fail_and_say_so(tmp_path):
    proc, run = grade(2, [PLANTED / "02_good_student.py"], "02", 30, tmp_path)
    v = {r["exercise"]: r for r in run["results"]}
    assert v["2.1"]["verdict"] == "FAIL" and "needs at least 3 ranks, graded on 2" in v["2.1"]["message"]
    assert v["2.2"]["verdict"] == "PASS" and proc.returncode == 1


@pytest.mark.parametrize("name", ["02_data_parallel.py", "09_moe.py"])
def test_an_untouched_stub_is_todo_at_any_rank_count(tmp_path, name):
    """Below the 3 ranks a multi-rank exercise needs, an untouched stub is still TODO (not FAIL)."""
    stubs = ROOT / "lessons" / "exercises" / name
    proc, run = grade(2, [stubs], name[:2], 30, tmp_path)
    assert [r["verdict"] for r in run["results"]] == ["TODO", "TODO"], proc.stdout + proc.stderr


def test_bad_flags_under_mpirun_are_one_line_once_and_exit_2():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for args in (["--only", "7.7", "--"], ["--timeout", "0"], ["--ranks", "3"]):
        proc = subprocess.run([*mpirun_cmd(3), sys.executable, "-m", "minidist.grade", *args,
                               str(PLANTED / "01_good_student.py")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = our_lines(proc.stdout + proc.stderr)
        assert len(lines) == 1 and "error:" in lines[0], lines
        assert "might wait" not in proc.stderr


ALL_04 = {
    "04_good_student.py": {"4.1": None, "4.2": None, "4.3": None},
    "04_warmup_off_by_one.py": {"4.2": "rank 0 holds 2 micro-batches' activations at once"},
    "04_backward_before_forward.py": {"4.1": "rank 0 runs B0 before F0"},
    "04_send_before_recv.py": {"4.1": None, "4.2": None, "4.3": "did not finish"},
    "04_exchange_both_or_neither.py": {"4.3": "either of send and recv may be None (the first stage only sends, "
                                              "the last only receives)"},
    "04_exchange_send_tag.py": {"4.3": "(receive with recv's own source and tag: they are not send's dest and tag)"},
    "04_exchange_no_dtype.py": {"4.3": "returned a float64 array; recv asks for float32"},
}


def test_planted_04_bugs_fail_and_the_stubs_are_todo(tmp_path):
    """At 3 ranks: the stubs are TODO, a correct file PASSes, a 1F1B warm-up off by one and a
    backward before its forward FAIL at once in words, two facing blocking sends FAIL as a deadlock."""
    timeout = 6
    stubs = ROOT / "lessons" / "exercises" / "04_pipeline_parallel.py"
    proc, run = grade(3, [stubs] + [PLANTED / f for f in ALL_04], "04", timeout, tmp_path)
    rows = [r for r in run["results"] if r["file"] == str(stubs)]
    assert [r["verdict"] for r in rows] == ["TODO"] * 3, rows
    run["results"] = [r for r in run["results"] if r["file"] != str(stubs)]
    assert_rows(proc, run, ALL_04, timeout, deadlock=True)


ALL_08 = {
    "08_good_student.py": {"8.1": None, "8.2": None},
    "08_no_replay.py": {"8.2": "differs from the run without recomputation"},
    "08_saves_anyway.py": {"8.1": "bytes of activations while its output is alive"},
    "08_counter_moved.py": {"8.2": "put the counters back after the rerun"},
    "08_records_then_detaches.py": {"8.1": "the graph was recorded, then dropped"},
    "08_tensor_grads_only.py": {"8.2": "return one gradient per input"},
}


def test_planted_08_bugs_fail_and_the_stubs_are_todo(tmp_path):
    """Serial checks, graded under mpirun -n 1 as a class would run them."""
    stubs = ROOT / "lessons" / "exercises" / "08_activation_recompute.py"
    proc, run = grade(1, [stubs] + [PLANTED / f for f in ALL_08], "08", 30, tmp_path)
    assert [r["verdict"] for r in run["results"] if r["file"] == str(stubs)] == ["TODO"] * 2, run["results"]
    run["results"] = [r for r in run["results"] if r["file"] != str(stubs)]
    assert_rows(proc, run, ALL_08, 30, deadlock=False)


ALL_05 = {
    "05_good_student.py": {"5.1": None, "5.2": None},
    "05_partition_off_by_one.py": {"5.1": "numpy.array_split gives the first"},
    "05_no_average.py": {"5.2": "divide by N = comm.Get_size()"},
    "05_average_twice.py": {"5.2": "divided twice?"},
    "05_full_all_reduce.py": {"5.2": "that is a full all-reduce"},
    "05_divide_by_4.py": {"5.2": "after passing on all 4 ranks"},
    "05_reused_buffer.py": {"5.2": "changed when reduce_scatter_grad was called again with other gradients"},
    "05_float32_result.py": {"5.2": "the result is float32, the gradient is float64"},
}
ALL_06 = {"06_good_student.py": {"6.1": None, "6.2": None},
          "06_never_frees.py": {"6.1": None, "6.2": "still holds"},
          "06_free_keeps_ref.py": {"6.2": "still referenced after free_params: FSDP would free nothing"},
          "06_gather_keeps_buffer.py": {"6.1": "still referenced after free_params: FSDP would free nothing"},
          "06_free_no_dtype.py": {"6.2": "became float64; keep the unit's dtype float32"}}


@pytest.mark.parametrize("exercise, files", [("05", ALL_05), ("06", ALL_06)])
def test_planted_05_06_zero_bugs_fail_at_4_ranks(tmp_path, exercise, files):
    """Uneven partition bounds, averaging twice or not at all, an all-reduce where a
    reduce-scatter belongs (right values, twice the bytes), a unit never freed: each FAILs
    in words, at once; a student's own correct file PASSes."""
    proc, run = grade(4, [PLANTED / f for f in files], exercise, 10, tmp_path)
    assert_rows(proc, run, files, 10, deadlock=False)


ALL_07 = {"07_good_student.py": {"7.1": None, "7.2": None},
          "07_pp_fastest.py": {"7.1": "tp varies fastest", "7.2": "in tp_rank order"},
          "07_off_by_one.py": {"7.1": None, "7.2": "returned [], expected [0]"},
          "07_float_coords.py": {"7.1": "coordinates are integers, not float64"},
          "07_group_set.py": {"7.2": "returned a set: a group is ordered"}}


def test_planted_07_grid_bugs_fail_and_the_stubs_are_todo(tmp_path):
    """Serial checks over many factorisations, graded under mpirun -n 4 (the plug-in check runs
    lesson 07 on a 2 x 2 grid): pp fastest and a
    group one member short FAIL in words; a student's own correct file PASSes."""
    stubs = ROOT / "lessons" / "exercises" / "07_3d_parallel.py"
    proc, run = grade(4, [stubs] + [PLANTED / f for f in ALL_07], "07", 30, tmp_path)
    assert [r["verdict"] for r in run["results"] if r["file"] == str(stubs)] == ["TODO"] * 2, run["results"]
    run["results"] = [r for r in run["results"] if r["file"] != str(stubs)]
    assert_rows(proc, run, ALL_07, 30, deadlock=False)


# ----------------------------------------------------------------------------- files that say what they expect
# A planted file may carry its own expectation, beside its bug, as module-level literals:
#   EXPECT = {"3.10": "words its FAIL message must hold", "3.11": None}   (None: must PASS;
#            an exercise not named must FAIL with "the file has no function named")
#   RANKS = 3            the world size to grade it at (default 3; 1 for serial exercises)
#   TIMEOUT = 10         the check's --timeout (default 10)
#   ALONE = True         grade it in a job of its own (its bug leaves a rank blocked in MPI,
#                        after which the job grades nothing more)
#   DEADLOCK = True      its failure may take the whole timeout
# Files of one exercise, rank count and timeout share one job.
OLD = set(re.findall(r'"(\d\d_\w+\.py)"', Path(__file__).read_text()))   # the files named above


def declared(path):
    """The file's EXPECT, RANKS, TIMEOUT, ALONE and DEADLOCK (None when it has no EXPECT)."""
    import ast
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("EXPECT", "RANKS", "TIMEOUT", "ALONE", "DEADLOCK"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    if "EXPECT" not in found:
        return None
    return dict(expect=found["EXPECT"], ranks=found.get("RANKS", 3), timeout=found.get("TIMEOUT", 10),
                alone=found.get("ALONE", False), deadlock=found.get("DEADLOCK", False))


def declared_jobs():
    jobs = {}
    for path in sorted(PLANTED.glob("[0-9][0-9]_*.py")):
        d = declared(path)
        if d is None:
            assert path.name in OLD, f"{path.name} says nothing of what it expects: give it an EXPECT"
            continue
        if path.name in OLD:          # graded by a test of its own above
            continue
        key = (path.name[:2], d["ranks"], d["timeout"], path.name if d["alone"] else "")
        jobs.setdefault(key, []).append((path, d))
    return sorted(jobs.items())


@pytest.mark.parametrize("key, members", declared_jobs(), ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else "")
def test_planted_files_that_declare_their_verdicts(tmp_path, key, members):
    exercise, ranks, timeout, _ = key
    expected = {p.name: d["expect"] for p, d in members}
    proc, run = grade(ranks, [p for p, _ in members], exercise, timeout, tmp_path)
    assert_rows(proc, run, expected, timeout, deadlock=any(d["deadlock"] for _, d in members))


def test_the_teachers_form_grades_each_file_in_jobs_of_its_own(tmp_path):
    """Acceptance: `python -m minidist.grade --exercise 04 --ranks 3,4 FOLDER --json out.json`
    with a file that swallows the grader's stop (its check never ends) beside a correct file:
    the correct one PASSes at both rank counts."""
    folder = tmp_path / "submissions"
    folder.mkdir()
    (folder / "alice.py").write_text((PLANTED / "04_swallows_the_stop.py").read_text())
    (folder / "bob.py").write_text((PLANTED / "04_good_student.py").read_text())
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MINIDIST_MPIRUN=shlex.join(MPIRUN))
    proc = subprocess.run([sys.executable, "-m", "minidist.grade", "--exercise", "04", "--ranks", "3,4",
                           "--only", "4.3", "--timeout", "3", folder, "--json", out],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    run = json.loads(out.read_text())
    got = {(Path(r["file"]).name, r["ranks"]): (r["verdict"], r["message"]) for r in run["results"]}
    assert got[("bob.py", 3)][0] == got[("bob.py", 4)][0] == "PASS", proc.stdout + proc.stderr
    assert got[("alice.py", 3)][0] == got[("alice.py", 4)][0] == "FAIL"
    assert "did not finish within 3 s" in got[("alice.py", 3)][1], got
    assert proc.returncode == run["exit_code"] == 1 and run["ranks"] == [3, 4]
    assert [(Path(f["file"]).name, f["passed"], f["total"]) for f in run["files"]] == [("alice.py", 0, 2),
                                                                                      ("bob.py", 2, 2)]
