"""Lesson 08 runs, matches and reports; bad input exits 2 with one message."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]
LESSON = ["-m", "minidist.lessons.08_activation_recompute"]
SMALL = ["--n-layer", "3", "--n-embd", "32", "--block-size", "16", "--batch-size", "4", "--steps", "2",
         "--sweep", "4,9"]


def run(*args):
    return subprocess.run([sys.executable, *LESSON, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_default_policies_match_and_report(tmp_path):
    out = tmp_path / "o.json"
    proc = run(*SMALL, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["match"] is True and rep["max_rel_diff"] <= 1e-12 and rep["lesson"] == "08_activation_recompute"
    f = rep["figures"]
    for p in ("none", "full", "every_k", "selective"):
        assert f[f"{p}_blocks_peak_bytes_measured"] == f[f"{p}_blocks_peak_bytes_count"]
    assert f["full_blocks_peak_bytes_measured"] < f["selective_blocks_peak_bytes_measured"] < \
        f["none_blocks_peak_bytes_measured"]
    assert f["sweep_L9_none_bytes"] * 4 == f["sweep_L4_none_bytes"] * 9


@pytest.mark.parametrize("bad", [["--policy", "sometimes"], ["--k", "0"], ["--n-head", "3", "--n-embd", "48", "--tp", "2"]])
def test_bad_input_exits_2_with_one_message(bad):
    proc = run(*SMALL, *bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("error:") == 1, proc.stderr


@needs_mpirun
def test_inside_the_pipeline_every_rank_peak_equals_its_count(tmp_path):
    """--pp 2 at 2 ranks (lesson 07's stages, 1F1B): every policy equal to none, each rank's
    peak over its own stage's blocks (3 and 2 of 5 layers) equal to the count for them."""
    import os
    out = tmp_path / "o.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    small = [a if a != "3" else "5" for a in SMALL]            # 5 layers: uneven stages
    proc = subprocess.run([*mpirun_cmd(2), sys.executable, *LESSON, *small, "--pp", "2",
                           "--micro-batches", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["match"] is True and rep["parallel"]["pp"] == 2 and rep["max_rel_diff"] <= 1e-12, rep
    f = rep["figures"]
    for p in ("none", "full", "every_k", "selective"):
        got, want = f[f"{p}_rank_blocks_peak_bytes_measured"], f[f"{p}_rank_blocks_peak_bytes_count"]
        assert got == want and len(got) == 2, (p, got, want)
    assert f["none_rank_blocks_peak_bytes_measured"][0] > f["none_rank_blocks_peak_bytes_measured"][1]
    assert f["full_rank_blocks_peak_bytes_measured"][0] < f["none_rank_blocks_peak_bytes_measured"][0]
