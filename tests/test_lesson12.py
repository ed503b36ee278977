"""Lesson 12 (the planner) as a class runs it: one process, the default 70B on 1024 H100s,
--json; its own checks (the ZeRO paper's figures, the bubble and the first stage's
micro-batches in flight against the simulated schedule, the choice under each cap) hold;
the published table prints every row with its error; every line fits 100 columns; the
exit status is 0 exactly when every check holds; bad input gets one line and exit 2.
(--measure, at 8 ranks, is not run here: it takes minutes.)"""
import json
import os
import subprocess
import sys

import pytest

from minidist.report import REPORT_KEYS
from minidist.plan import published

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           MINIDIST_NO_WRAP="1")        # the lines as the lesson builds them: each must fit 100 columns
LESSON = "minidist.lessons.12_plan"


def run(*flags):
    return subprocess.run([sys.executable, "-m", LESSON, *flags], capture_output=True, text=True,
                          timeout=120, env=ENV)


def test_lesson_12_walks_the_70b_and_prints_the_published_rows(tmp_path):
    out = tmp_path / "report.json"
    proc = run("--json", str(out))
    report = json.loads(out.read_text())
    checks = report["figures"]["checks"]
    assert proc.returncode == (0 if all(checks.values()) else 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["match"] is all(checks.values())
    assert {k: checks[k] for k in ("zero_paper", "bubble", "in_flight", "choice")} == dict.fromkeys(
        ("zero_paper", "bubble", "in_flight", "choice"), True), proc.stdout
    assert set(REPORT_KEYS) <= set(report)
    assert report["figures"]["model_states"]["zero"] == {"weights": 140e9, "grads": 140e9, "optimizer": 840e9}
    assert "1,120.0 GB" in proc.stdout and "the same to the paper's digits" in proc.stdout
    assert len(report["layouts"]) == 5
    for lay in report["layouts"]:
        assert lay["tp"] * lay["pp"] * lay["dp"] == 1024
        assert {"micro_batch", "step_time_s", "tflops_per_gpu_model", "tflops_per_gpu_hardware", "mfu", "hfu",
                "memory_bytes_per_gpu", "fits"} <= set(lay)
    rows = report["published"]["rows"]
    assert len(rows) == len(published.ROWS)
    for r in rows:
        assert abs(r["rel_error"] - (r["predicted"] / r["published"] - 1)) < 1e-12
        assert r["label"] in proc.stdout and f"{100 * r['rel_error']:+.1f}%" in proc.stdout
    assert f"mean |error| {report['published']['mean_abs_error']:.1%}" in proc.stdout
    # per row the source, the prediction, the in-sample and the held-out error; the
    # held-out (leave-one-source-out) verdict first; the goals printed, met or not, never failed
    pub = report["published"]
    for r in rows:
        assert r["source"] and r["predicted"] > 0 and isinstance(r["rel_error"], float)
        assert r["loso_error"] is None or isinstance(r["loso_error"], float)
    held = f"held out by source: mean |error| {pub['loso_mean_abs_error']:.1%}"
    in_sample = f"in sample: mean |error| {pub['mean_abs_error']:.1%}"
    assert held in proc.stdout and in_sample in proc.stdout
    assert proc.stdout.index(held) < proc.stdout.index(in_sample)
    assert "published" not in checks and set(report["figures"]["published_goals"]) == {"held_out", "in_sample"}
    for goal in report["figures"]["published_goals"].values():
        assert goal in (True, False)
    assert proc.stdout.count(": not met") == list(report["figures"]["published_goals"].values()).count(False)
    # the report's path is the temporary folder's length, not the lesson's
    wide = [line for line in proc.stdout.splitlines() if len(line) > 100 and str(tmp_path) not in line]
    assert not wide, wide


def test_bad_input_gets_one_line_and_exit_2():
    proc = run("--gpus", "1020")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "1020 GPUs is not a multiple of the node size 8" in lines[0], proc.stderr


def lesson():
    import importlib
    return importlib.import_module(LESSON)


@pytest.mark.parametrize("flags, words", [
    (["--gpus", "8", "--params", "1e12"], "no layout of a 1e+12-parameter model fits 8 h100-sxm"),
    (["--gpus", "12"], "12 GPUs is not a multiple of the node size 8"),
])
def test_a_cluster_that_cannot_work_is_an_input_error(flags, words):
    """In this process (the harness turns an InputError into one line and exit 2, as above),
    refused before the lesson prints a line."""
    from mpi4py import MPI
    from minidist.lessons import harness
    mod = lesson()
    args = mod.build_parser().parse_args([*flags, "--no-published"])
    with harness.running(MPI.COMM_SELF) as said:
        with pytest.raises(harness.InputError, match=words.replace("+", r"\+")):
            mod.main(args)
    assert said.lines == []


def test_an_unknown_gpu_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        lesson().build_parser().parse_args(["--gpu", "b200"])
    assert stop.value.code == 2 and "invalid choice: 'b200'" in capsys.readouterr().err


def fake_measure(rho, best, two, same_bytes=True):
    rows = [{"tp": t, "pp": p, "dp": 8 // (t * p), "micro_batches": 4, "measured_step_s": 0.1 * (i + 1),
             "predicted_step_s": 0.1 * (i + 1), "predicted": dict.fromkeys(
                 ("compute_s", "tp_s", "pp_s", "dp_s", "bubble_s", "optimizer_s"), 0.01),
             "bytes_match": same_bytes or i != 1}
            for i, (t, p) in enumerate(((1, 1), (2, 1), (2, 2)))]
    return {"measured": rows, "spearman": rho, "best_measured": best, "best_predicted_two": two,
            "best_in_predicted_two": best in two, "bytes_match": same_bytes}


@pytest.mark.parametrize("rho, best, same_bytes, agree", [
    (0.9, "1x1x8", True, True), (0.7, "1x1x8", True, False), (0.95, "2x2x2", True, False),
    (None, "1x1x8", True, False), (0.9, "1x1x8", False, False)])
def test_the_measure_verdict_needs_rho_the_best_among_the_predicted_two_and_the_bytes(
        monkeypatch, rho, best, same_bytes, agree):
    """The section's verdict from plan_measure.run's result (the run itself, 8 ranks for
    minutes, is not part of the suite; its byte counts are in tests/mpi/test_links.py)."""
    from mpi4py import MPI
    from minidist.lessons import harness
    from minidist.lessons import plan_measure as measure
    monkeypatch.setattr(measure, "run", lambda comm: fake_measure(rho, best, ["1x1x8", "2x1x4"], same_bytes))
    with harness.running(MPI.COMM_SELF) as said:
        ok, result = lesson().measured(MPI.COMM_SELF)
    assert ok is agree and result["spearman"] == rho
    verdict = said.lines[-1] if said.lines[-1].strip() else said.lines[-2]
    assert ("the rankings agree" in verdict) is agree and ("DISAGREE" in verdict) is (not agree), said.lines
    assert all(len(line) <= 100 for line in said.lines), said.lines


def test_measure_on_one_rank_is_refused():
    from mpi4py import MPI
    from minidist.lessons import harness
    args = lesson().build_parser().parse_args(["--measure"])
    with harness.running(MPI.COMM_SELF), pytest.raises(harness.InputError, match="at least two of them"):
        lesson().main(args)


def test_the_measure_progress_weighs_the_time_left_by_the_predicted_steps():
    """--measure's progress line (plan_measure.Ahead): after a layout predicted at 1 s of 10,
    10 s spent leave 90 s, where a plain count (1 of 3 in 10 s) would say 20 s."""
    import io
    from minidist.lessons.plan_measure import Ahead
    now = [0.0]
    bar = Ahead([1, 1, 8], "layouts", stream=io.StringIO(), every=1, clock=lambda: now[0])
    now[0] = 10.0
    assert bar.line(1, "1 x 1 x 8") == "layouts  1/3  1 x 1 x 8  ~ 1:30 left"
    now[0] = 20.0
    assert bar.line(2).endswith("~ 1:20 left") and bar.line(3).endswith("done in 0:20")
