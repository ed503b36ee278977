"""Lesson 11 (checkpoints) under mpirun: saved under one layout, a save killed with SIGKILL,
resumed under another layout, equal to one process without a stop (float64, 1e-10);
a damaged checkpoint given to --resume gets one message and exit 2 on every rank."""
import json
import os
import subprocess
import sys

import pytest

from minidist.lessons.harness import REPORT_KEYS

from launcher import mpirun_cmd, needs_mpirun, our_lines

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           MINIDIST_NO_WRAP="1")        # the lines as the lesson builds them: each must fit 100 columns
LESSON = "minidist.lessons.11_checkpoints"
pytestmark = needs_mpirun


def mpirun(n, flags, timeout=120):
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", LESSON, *flags],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.parametrize("n, flags", [
    (4, []),                                                                # ZeRO-3 -> TP 2 x PP 2
    (3, ["--save-layout", "zero2", "--resume-layout", "dp", "--batch-size", "6", "--no-kill"]),
], ids=["n4-zero3-to-tp2pp2", "n3-zero2-to-dp"])
def test_lesson_11_resumes_under_another_layout(tmp_path, n, flags):
    out = tmp_path / "report.json"
    proc = mpirun(n, [*flags, "--dir", str(tmp_path / "ckpt"), "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(REPORT_KEYS) <= set(report) and report["match"] is True and report["max_rel_diff"] <= 1e-10
    assert len(report["losses"]["resumed"]) == report["steps"] == 6
    if "--no-kill" not in flags:
        assert report["figures"]["killed_save_left_latest_intact"] is True
        assert "latest still names step00000003; verify: ok" in proc.stdout
    wide = [line for line in proc.stdout.splitlines() if len(line) > 100 and "/" not in line]   # (paths vary)
    assert not wide, wide
    kept = sorted(f for f in os.listdir(tmp_path / "ckpt") if f.startswith("step"))
    assert kept == ["step00000003", "step00000006"]                       # --keep 2


def test_offload_to_disk_resumes_and_reports_the_bytes_it_moved(tmp_path):
    out = tmp_path / "report.json"
    proc = mpirun(3, ["--save-layout", "zero3", "--resume-layout", "zero1", "--offload", "disk", "--no-kill",
                      "--batch-size", "6", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["match"] is True
    moved = report["figures"]["offload"]
    assert moved["steps"] == 1 and moved["bytes_read"] == moved["state_bytes"] > 0    # stage 1: m and v, once
    assert "offload to disk (zero1)" in proc.stdout


def test_a_truncated_shard_gets_one_message_and_exit_2_on_every_rank(tmp_path):
    root = tmp_path / "ckpt"
    proc = mpirun(2, ["--save-layout", "zero1", "--resume-layout", "dp", "--no-kill", "--dir", str(root)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    latest = root / (root / "latest").read_text().strip()
    shard = latest / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])                           # cut its end off
    proc = mpirun(2, ["--resume-layout", "dp", "--resume", str(root)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in our_lines(proc.stderr) if "error" in line]
    assert len(errors) == 1 and "rank00001.safetensors" in errors[0], proc.stderr


def test_a_layout_that_does_not_fit_is_refused():
    proc = mpirun(3, ["--resume-layout", "tp2pp2"], timeout=60)
    assert proc.returncode == 2
    errors = [line for line in our_lines(proc.stderr) if "error" in line]
    assert len(errors) == 1 and "needs exactly 4 ranks" in errors[0], proc.stderr
