"""Lessons 05 (ZeRO) and 06 (FSDP) run end to end under mpirun, match one process, and
refuse bad input once on every rank (exit 2, one message, nothing run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.report import REPORT_KEYS

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
pytestmark = needs_mpirun


def mpirun(n, lesson, flags, timeout=120):
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", f"minidist.lessons.{lesson}", *flags],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def report_of(n, lesson, flags, tmp_path):
    out = tmp_path / "report.json"
    proc = mpirun(n, lesson, [*flags, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(REPORT_KEYS) <= set(report) and report["match"] is True and report["max_rel_diff"] <= 1e-10
    return report, proc.stdout


def test_lesson_05_all_stages_at_3_ranks(tmp_path):
    report, out = report_of(3, "05_zero", ["--stage", "all", "--grad-accum", "2", "--n-layer", "1"], tmp_path)
    f = report["figures"]
    for stage in ("0", "1", "2_naive", "2_overlap", "3"):
        assert f"stage{stage}_bytes_sent" in f, sorted(f)
    assert f["stage2_overlap_grads_peak_measured"] < f["stage2_naive_grads_peak_measured"]
    assert report["comm"]["bytes_sent"] == report["comm"]["expected_bytes"]
    assert "2 x (3 Psi - root)" in out and "2 Psi + Psi" in out and "DIFFERS" not in out


@pytest.mark.parametrize("n, flags", [(4, []), (3, ["--no-reshard", "--no-prefetch", "--grad-accum", "2"])])
def test_lesson_06_fsdp(tmp_path, n, flags):
    report, out = report_of(n, "06_fsdp", ["--n-layer", "2", *flags], tmp_path)
    f = report["figures"]
    assert f["params_gathered_peak_measured"] == f["params_gathered_peak_formula"]
    assert report["comm"]["bytes_sent"] == report["comm"]["expected_bytes"]
    assert "  root     |" in out and ("3 Psi - root" in out) == (not flags)


@pytest.mark.parametrize("lesson, flags, message", [
    ("05_zero", ["--stage", "4"], "argument --stage: invalid choice: '4'"),
    ("05_zero", ["--batch-size", "10"], "does not divide evenly among 4 data-parallel ranks"),
    ("06_fsdp", ["--batch-size", "10"], "does not divide evenly among 4 data-parallel ranks"),
    ("06_fsdp", ["--batch-size", "8", "--grad-accum", "3"], "--batch-size 8 with 4 ranks and --grad-accum 3"),
])
def test_bad_input_is_refused_once_with_exit_2(lesson, flags, message):
    proc = mpirun(4, lesson, flags)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Lesson" not in proc.stdout
