"""The lesson harness: per-tensor comparison, report keys, flags that fail cleanly."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist import cli, equivalence, report


def test_rel_diff_is_per_tensor_and_safe_on_zero_gradients():
    assert equivalence.rel_diff(np.zeros(3), np.zeros(3)) == (0.0, 0.0)
    r, a = equivalence.rel_diff(np.array([1.0, 2.0]), np.array([1.0, 4.0]))
    assert a == 2.0 and r == 0.5
    assert equivalence.rel_diff(np.array([1e-30]), np.zeros(1))[0] == float("inf")


def test_compare_reports_the_worst_tensor_and_missing_names():
    ref = {"a": np.ones(3), "b": np.full(2, 10.0)}
    par = {"a": np.ones(3), "b": np.array([10.0, 10.001])}
    rel, ab, name = equivalence.compare(par, ref)
    assert name == "b" and np.isclose(rel, 1e-4) and np.isclose(ab, 1e-3)
    assert equivalence.compare({"a": np.ones(3)}, ref) == (float("inf"), float("inf"), "b")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_anywhere_is_a_mismatch(bad):
    ref = {"a": np.ones(3), "b": np.ones(3), "c": np.ones(3)}
    par = {"a": np.ones(3), "b": np.array([1.0, bad, 1.0]), "c": np.ones(3)}
    assert equivalence.compare(par, ref)[0] == float("inf")
    assert equivalence.compare(par, ref)[2] == "b"
    assert equivalence.compare(ref, par)[0] == float("inf")


def test_report_has_every_key_and_writes_json(tmp_path):
    class Args:
        dtype, steps, json = "float64", 3, str(tmp_path / "r.json")
    rep = report.new_report("xx", Args, match=True, max_rel_diff=np.float64(1e-12), mfu=float("nan"))
    assert set(rep) == set(report.REPORT_KEYS)
    assert report.finish(rep, Args) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["match"] is True and data["max_rel_diff"] == 1e-12 and data["mfu"] is None
    assert data["comm"] is None
    with pytest.raises(KeyError):
        report.new_report("xx", Args, not_a_key=1)


@pytest.mark.parametrize("flags, message", [
    (["--n-embd", "30", "--n-head", "4"], "n_embd"),
    (["--block-size", "0"], "at least 1"),
    (["--dtype", "float16"], "invalid choice"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--dropout", "1.5"], "dropout"),
    (["--steps", "x"], "whole number"),
])
def test_bad_input_is_one_message_and_exit_2(flags, message):
    proc = subprocess.run([sys.executable, "-m", "minidist.lessons.00_single_process", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- flag types

@pytest.mark.parametrize("kind, good, bad", [
    (cli.positive_int, {"1": 1, "42": 42}, ["0", "-3", "1.5", "x"]),
    (cli.nonnegative_int, {"0": 0, "7": 7}, ["-1", "2.0", "x"]),
    (cli.positive_float, {"0.01": 0.01, "3": 3.0}, ["0", "-1", "nan", "inf", "x"]),
    (cli.nonnegative_float, {"0": 0.0, "0.5": 0.5}, ["-0.1", "nan", "-inf", "x"]),
])
def test_flag_types_accept_and_refuse(kind, good, bad):
    import argparse
    for text, value in good.items():
        assert kind(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)


def test_json_problem_finds_folders_missing_folders_and_unwritable_files(tmp_path):
    assert "is a folder" in cli.json_problem(str(tmp_path))
    assert "does not exist" in cli.json_problem(str(tmp_path / "no" / "r.json"))
    assert cli.json_problem(str(tmp_path / "new.json")) is None
    old = tmp_path / "old.json"
    old.write_text("keep me")
    assert cli.json_problem(str(old)) is None
    assert old.read_text() == "keep me", "the check must not change an existing file"


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="needs Linux /proc")
def test_json_problem_finds_a_file_that_cannot_be_written():
    # /proc/version exists and refuses writes even to a superuser, unlike a chmod 444 file
    assert "cannot be written" in cli.json_problem("/proc/version")


@pytest.mark.skipif(os.geteuid() == 0, reason="a superuser may write a read-only file")
def test_json_problem_finds_a_read_only_file(tmp_path):
    f = tmp_path / "ro.json"
    f.write_text("{}")
    f.chmod(0o444)
    assert "cannot be written" in cli.json_problem(str(f))


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "--seed: must be 0 or more"),
    (["--peak-tflops", "-1"], "--peak-tflops: must be more than 0"),
    (["--sample-tokens", "-5"], "--sample-tokens: must be 0 or more"),
    (["--eval-interval", "-1"], "--eval-interval: must be 0 or more"),
    (["--lr", "0"], "--lr: must be more than 0"),
])
def test_lesson_00_refuses_negative_flags(flags, message):
    proc = subprocess.run([sys.executable, "-m", "minidist.lessons.00_single_process", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and proc.stderr.count("error:") == 1
    assert proc.stdout == "", "nothing may run before the flags are checked"


@pytest.mark.parametrize("where", ["folder", "missing folder", "unwritable file"])
def test_lesson_00_refuses_a_json_path_it_cannot_write_before_training(tmp_path, where):
    if where == "unwritable file" and not os.path.exists("/proc/version"):
        pytest.skip("needs Linux /proc")
    path = {"folder": str(tmp_path), "missing folder": str(tmp_path / "no" / "r.json"),
            "unwritable file": "/proc/version"}[where]
    proc = subprocess.run([sys.executable, "-m", "minidist.lessons.00_single_process", "--json", path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(f"--json {path}:") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == "", "the check must come before the run, not after it"


@pytest.mark.parametrize("batch, world, accum, fixed", [(16, 3, 1, 18), (10, 4, 1, 12), (8, 3, 2, 12),
                                                        (2, 4, 1, 4)])
def test_a_batch_that_does_not_split_gets_the_next_one_that_does(monkeypatch, batch, world, accum, fixed):
    """common.batch_rows' refusal ends with a command that works: the next batch size that
    splits over the ranks and the accumulation steps, every other flag kept."""
    from types import SimpleNamespace
    from minidist.lessons import common
    monkeypatch.setattr(sys, "argv", ["lesson.py", "--steps", "2", "--batch-size", str(batch)])
    with pytest.raises(cli.InputError) as err:
        common.batch_rows(SimpleNamespace(batch_size=batch, grad_accum=accum), 0, world)
    said = str(err.value)
    assert f"this works: mpirun -n {world} python -m " in said, said
    assert said.endswith(f" --steps 2 --batch-size {fixed}"), said
