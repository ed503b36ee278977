"""Lesson 10 (mixed precision, compression, curriculum) runs end to end under mpirun at a
tiny shape: every variant, one row each in the JSON with its validation loss and its
bytes per step equal to the formula at every step, the exact checks all holding; bad
input gets one message and exit 2 on every rank. (The convergence figures belong to the
lesson's own runs, not to these tests.)"""
import json
import os
import subprocess
import sys

import pytest

from minidist.report import REPORT_KEYS

from launcher import mpirun_cmd, needs_mpirun, our_lines

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           MINIDIST_NO_WRAP="1")        # the lines as the lesson builds them: each must fit 100 columns
LESSON = "minidist.lessons.10_precision_and_compression"
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--steps", "6",
        "--eval-interval", "3", "--eval-iters", "1"]
pytestmark = needs_mpirun


def mpirun(n, flags, timeout=180):
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", LESSON, *flags],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.parametrize("n, flags, names", [
    (2, ["--batch-size", "4"], ["fp32", "bf16", "fp16", "comp fp16", "int8", "1bit-grad w=1",
                                "1bit-adam w=1", "powersgd r=4", "curriculum"]),
    (3, ["--batch-size", "6", "--precision", "bf16", "--zero", "2", "--grad-reduce", "16"], ["fp32", "bf16"]),
    (2, ["--batch-size", "4", "--compressor", "int8"], ["fp32", "int8"]),      # no goal: no heading
    (2, ["--batch-size", "4", "--precision", "fp16", "--zero", "1"], ["fp32", "fp16"]),
], ids=["n2-every-variant", "n3-bf16-zero2", "n2-int8-alone", "n2-fp16-zero1"])
def test_lesson_10_reports_every_variant(tmp_path, n, flags, names):
    out = tmp_path / "report.json"
    proc = mpirun(n, [*TINY, *flags, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(REPORT_KEYS) <= set(report) and report["match"] is True
    rows = report["variants"]
    assert [r["variant"] for r in rows] == names
    for r in rows:
        assert r["val_loss"] > 0 and r["bytes_match_every_step"] is True
        assert r["bytes_per_step"] == r["bytes_per_step_formula"] > 0
        assert r["tokens"] >= 6 * int(flags[1]) * 16
    by = {r["variant"]: r for r in rows}
    if "--zero" in flags and "fp16" in by:       # a skipped step sends no all-gather: formula too
        assert by["fp16"]["skipped_steps"] >= 1
    if "1bit-grad w=1" in by:
        for name in ("1bit-grad w=1", "1bit-adam w=1"):
            assert by[name]["ratio_per_step"] < 0.05 < by[name]["ratio_run"]            # warm-up counted
        assert by["fp16"]["bytes_per_step"] * 2 == by["fp32"]["bytes_per_step"]        # 16-bit reduce
        assert by["curriculum"]["steps"] > by["fp32"]["steps"]                         # same tokens
    checks = report["figures"]["exact_checks"]
    assert len(checks) >= 4 and all(c["ok"] for c in checks), checks
    assert "verdict: MATCH" in proc.stdout and "FAIL" not in proc.stdout
    lines = proc.stdout.splitlines()
    wide = [line for line in lines if len(line) > 100 and "/" not in line]   # (paths vary)
    assert not wide, wide
    empty = [a for a, b in zip(lines, lines[1:] + [""]) if a.endswith(":") and not b.strip()]
    assert not empty, f"headings with nothing under them: {empty}"
    steps = [line for line in lines if "tokens, step" in line]       # progress: that step's loss
    assert steps and all(" loss " in line and "val" not in line for line in steps), steps


@pytest.mark.parametrize("flags, words", [
    (["--compressor", "1bit", "--warmup-steps", "123456", "--steps", "100000"],      # (wide numbers)
     "is not below --steps 100000: nothing to compress (try 25000)"),
    (["--compressor", "powersgd", "--rank", "999999"], "more than the largest matrix allows"),
    (["--compressor", "gzip"], "'gzip' is unknown"),
    (["--compressor", "1bit-adam", "--warmup-steps", "0"], "needs --warmup-steps 1 or more"),
], ids=["warmup-too-long", "rank-too-large", "unknown-compressor", "onebit-adam-no-warmup"])
def test_bad_input_gets_one_message_and_exit_2(flags, words):
    proc = mpirun(2, [*TINY, "--batch-size", "4", *flags], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in our_lines(proc.stderr) if "error" in line]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    wide = [line for line in our_lines(proc.stdout + proc.stderr) if len(line) > 100]
    assert not wide, wide                                           # every line within 100 columns
