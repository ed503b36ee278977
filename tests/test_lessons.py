"""Each lesson runs end to end, writes its report with the architecture's keys, and matches."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.report import REPORT_KEYS

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun



def run(cmd, tmp_path, n=None):
    out = tmp_path / "report.json"
    prefix = [*mpirun_cmd(n)] if n else []
    proc = subprocess.run(prefix + [sys.executable, "-m", *cmd, "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(REPORT_KEYS) <= set(report), f"missing keys: {set(REPORT_KEYS) - set(report)}"
    assert report["match"] is True
    return report, proc.stdout


def test_lesson_00_trains_checks_gradients_and_samples(tmp_path):
    report, out = run(["minidist.lessons.00_single_process", "--steps", "30", "--n-layer", "2",
                       "--n-embd", "64", "--sample-tokens", "40", "--eval-interval", "15"], tmp_path)
    losses = report["losses"]["reference"]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5, "the loss should fall"
    assert report["max_rel_diff"] <= report["tolerance"]
    assert report["comm"] is None and report["world_size"] == 1
    assert all(report["memory"][k] > 0 for k in ("params", "grads", "optimizer", "activations_peak"))
    assert 0 < report["mfu"] < 1 and report["step_time_s"] > 0
    assert "sample (40 tokens" in out and "validation:" in out


@needs_mpirun
@pytest.mark.parametrize("flags", [[], ["--naive", "--grad-accum", "2"]])
def test_lesson_02_matches_on_three_ranks(tmp_path, flags):
    report, out = run(["minidist.lessons.02_data_parallel", "--timing-reps", "1", *flags], tmp_path, n=3)
    assert report["world_size"] == 3 and report["parallel"]["dp"] == 3
    assert report["max_rel_diff"] <= 1e-10
    sent, expected = report["comm"]["bytes_sent"]["all_reduce"], report["comm"]["expected_bytes"]["all_reduce"]
    assert abs(sent - expected) <= 0.01 * expected
    assert "replicas after training: identical" in out


@needs_mpirun
def test_lesson_02_refuses_a_batch_that_does_not_divide(tmp_path):
    proc = subprocess.run([*mpirun_cmd(4), sys.executable, "-m", "minidist.lessons.02_data_parallel",
                           "--batch-size", "10"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("does not divide evenly") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def mpirun_lesson(lesson, flags, n=3):
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", f"minidist.lessons.{lesson}", *flags],
                          capture_output=True, text=True, timeout=120)


def assert_refused_once(proc, message):
    """Exit 2, the message once (rank 0 speaks for all), nothing run, no traceback."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Abort" not in proc.stderr, proc.stderr
    assert "Lesson" not in proc.stdout, "the flags must be checked before the lesson starts"


@needs_mpirun
def test_lesson_00_under_mpirun_says_it_is_single_process(tmp_path):
    assert_refused_once(mpirun_lesson("00_single_process", []), "single-process lesson")


@needs_mpirun
@pytest.mark.parametrize("flags, message", [
    (["--size-mib", "0"], "--size-mib: must be more than 0"),
    (["--size-mib", "-2"], "--size-mib: must be more than 0"),
    (["--size-mib", "1e9"], "choose a smaller --size-mib"),
    (["--seed", "-1"], "--seed: must be 0 or more"),
    (["--json", "FOLDER"], "that is a folder"),
])
def test_lesson_01_refuses_bad_flags_once_on_every_rank(tmp_path, flags, message):
    flags = [str(tmp_path) if f == "FOLDER" else f for f in flags]
    assert_refused_once(mpirun_lesson("01_collectives", flags), message)


@needs_mpirun
@pytest.mark.parametrize("flags, message", [
    (["--grad-clip", "-1"], "--grad-clip: must be 0 or more"),
    (["--peak-tflops", "-3"], "--peak-tflops: must be more than 0"),
    (["--json", "/proc/version"], "cannot be written"),
])
def test_lesson_02_refuses_bad_flags_once_on_every_rank(flags, message):
    if "/proc/version" in flags and not Path("/proc/version").exists():
        pytest.skip("needs Linux /proc")
    assert_refused_once(mpirun_lesson("02_data_parallel", flags), message)


@needs_mpirun
def test_lesson_04_refuses_a_latency_too_long_to_draw_once_on_every_rank():
    proc = mpirun_lesson("04_pipeline_parallel", ["--latency", "11"], n=2)
    assert_refused_once(proc, "--latency: must be at most 10")


@needs_mpirun
def test_lesson_04_refuses_a_trace_into_a_missing_folder_before_it_runs():
    """Every output path is checked up front, as --json is: not after the whole run."""
    proc = mpirun_lesson("04_pipeline_parallel", ["--trace", "/no/such/dir/t.json"], n=2)
    assert_refused_once(proc, "--trace /no/such/dir/t.json: the folder /no/such/dir does not exist")


@needs_mpirun
def test_lesson_04_latency_shows_what_the_warmup_factor_buys(tmp_path):
    """Interleaved at p = 2, m = 4, v = 2 with messages of a quarter of a chunk's forward: the
    picture and the bubble with the latency, the schedule without the factor 2 beside today's
    (the same bubble with free messages, a longer one with the latency), lines of at most 100."""
    report, out = run(["minidist.lessons.04_pipeline_parallel", "--schedule", "interleaved", "--n-layer", "4",
                       "--n-embd", "16", "--block-size", "8", "--batch-size", "4", "--steps", "1",
                       "--latency", "0.25"], tmp_path, n=2)
    fig = report["figures"]
    assert fig["bubble_simulated"] == fig["bubble_formula"] == fig["bubble_simulated_warmup_factor_1"]
    assert fig["bubble_simulated"] < fig["bubble_simulated_latency"] < fig["bubble_simulated_latency_warmup_factor_1"]
    assert "the same schedule without the factor 2" in out and "2(pv-1) x 0.25" in out
    assert max(len(line) for line in out.splitlines()) <= 100, max(out.splitlines(), key=len)


@needs_mpirun
@pytest.mark.parametrize("lesson, n, flags, message", [
    ("03_tensor_parallel", 3, [], "--n-head 8 is not divisible by the tensor-parallel size 3"),
    ("03_tensor_parallel", 3, ["--n-head", "6"], "n_embd (64) must be a multiple of n_head (6)"),
    ("07_3d_parallel", 3, ["--tp", "3"], "--tp 3 must divide the 4 heads"),
    ("08_activation_recompute", 3, ["--tp", "3", "--sweep", "2"],      # (a short sweep: the hint keeps it)
     "--n-head 4 is not divisible by the tensor-parallel size 3"),
])
def test_a_world_size_that_does_not_fit_gets_one_command_that_works(lesson, n, flags, message):
    """The hint fixes the whole problem at once: the command it prints runs and matches."""
    small = ["--steps", "1"]
    proc = mpirun_lesson(lesson, flags + small, n=n)
    assert_refused_once(proc, message)
    said = next(line for line in proc.stderr.splitlines() if "this works: " in line)
    hint = said.split("this works: ")[1].split()
    assert hint[:2] == ["mpirun", "-n"] and hint[3:6] == ["python", "-m", f"minidist.lessons.{lesson}"], hint
    fixed = mpirun_lesson(lesson, hint[6:], n=int(hint[2]))
    assert fixed.returncode == 0 and "verdict: MATCH" in fixed.stdout, fixed.stdout[-1500:] + fixed.stderr[-1500:]
