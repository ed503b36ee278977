"""The lesson harness: per-tensor comparison, report keys, flags that fail cleanly."""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.lessons import harness


def test_rel_diff_is_per_tensor_and_safe_on_zero_gradients():
    assert harness.rel_diff(np.zeros(3), np.zeros(3)) == (0.0, 0.0)
    r, a = harness.rel_diff(np.array([1.0, 2.0]), np.array([1.0, 4.0]))
    assert a == 2.0 and r == 0.5
    assert harness.rel_diff(np.array([1e-30]), np.zeros(1))[0] == float("inf")


def test_compare_reports_the_worst_tensor_and_missing_names():
    ref = {"a": np.ones(3), "b": np.full(2, 10.0)}
    par = {"a": np.ones(3), "b": np.array([10.0, 10.001])}
    rel, ab, name = harness.compare(par, ref)
    assert name == "b" and np.isclose(rel, 1e-4) and np.isclose(ab, 1e-3)
    assert harness.compare({"a": np.ones(3)}, ref) == (float("inf"), float("inf"), "b")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_anywhere_is_a_mismatch(bad):
    ref = {"a": np.ones(3), "b": np.ones(3), "c": np.ones(3)}
    par = {"a": np.ones(3), "b": np.array([1.0, bad, 1.0]), "c": np.ones(3)}
    assert harness.compare(par, ref)[0] == float("inf")
    assert harness.compare(par, ref)[2] == "b"
    assert harness.compare(ref, par)[0] == float("inf")


def test_report_has_every_key_and_writes_json(tmp_path):
    class Args:
        dtype, steps, json = "float64", 3, str(tmp_path / "r.json")
    rep = harness.new_report("xx", Args, match=True, max_rel_diff=np.float64(1e-12), mfu=float("nan"))
    assert set(rep) == set(harness.REPORT_KEYS)
    assert harness.finish(rep, Args) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["match"] is True and data["max_rel_diff"] == 1e-12 and data["mfu"] is None
    assert data["comm"] is None
    with pytest.raises(KeyError):
        harness.new_report("xx", Args, not_a_key=1)


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
