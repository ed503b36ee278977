"""Lesson 07 as a class runs it: 8 ranks, tp 2 x pp 2 x dp 2 with ZeRO-1 and dropout, the
report's verdict, bytes and memory beside the formulas; 12 ranks, 3 x 2 x 2 with every-k
recomputation (a serial test that launches mpirun -n 12); a factorisation that does not
fit exits 2 with one message."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]
pytestmark = needs_mpirun


def lesson(n, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", "minidist.lessons.07_3d_parallel",
                           *flags], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_lesson_07_matches_at_8_ranks_with_zero_and_dropout(tmp_path):
    out = tmp_path / "out.json"
    proc = lesson(8, "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--dropout", "0.1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["match"] is True and rep["max_rel_diff"] <= 1e-10, rep
    assert rep["parallel"]["tp"] == rep["parallel"]["pp"] == rep["parallel"]["dp"] == 2
    assert rep["comm"]["bytes_sent"] == rep["comm"]["expected_bytes"], rep["comm"]
    assert all(rep["comm"]["bytes_sent"][g] > 0 for g in ("tp", "pp", "dp", "clip")), rep["comm"]
    assert proc.stdout.count("who holds what") == 1 and "verdict: MATCH" in proc.stdout
    mem = rep["memory"]                            # ZeRO-1: within array_split's one element
    item = 8
    assert abs(mem["grads"] - mem["grads_formula"]) < item and abs(mem["optimizer"] - mem["optimizer_formula"]) < 2 * item
    assert mem["params"] == mem["params_formula"], mem


@pytest.mark.parametrize("flags, words", [(("--tp", "3"), "does not divide the 4 ranks"),
                                          (("--tp", "2", "--pp", "2", "--dp", "2"), "the world has 4"),
                                          (("--tp", "4", "--n-head", "6", "--n-embd", "48"), "must divide the 6 heads"),
                                          (("--pp", "4", "--n-layer", "3"), "only 3 layers")])
def test_bad_input_exits_2_with_one_message(flags, words):
    proc = lesson(4, *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).count("error:") == 1 and words in proc.stderr, proc.stdout + proc.stderr


def test_lesson_07_at_12_ranks_3x2x2_with_heads_divisible_by_3(tmp_path):
    """THE 12-RANK RUN: mpirun -n 12 on whatever cores there are (about 7 s on 2 cores).
    tp 3 x pp 2 x dp 2, 6 heads of 8 (3 divides them), the vocabulary of 256 padded to 258
    for tp 3; with every-k recomputation (k = 1 on each 2-layer stage) so the rerun's bytes
    are held to the formula too."""
    out = tmp_path / "out.json"
    proc = lesson(12, "--tp", "3", "--pp", "2", "--dp", "2", "--n-head", "6", "--n-embd", "48",
                  "--recompute", "every-k", "--k", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["match"] is True and rep["max_rel_diff"] <= 1e-10, rep
    assert (rep["parallel"]["tp"], rep["parallel"]["pp"], rep["parallel"]["dp"]) == (3, 2, 2)
    assert rep["comm"]["bytes_sent"] == rep["comm"]["expected_bytes"], rep["comm"]
    mem = rep["memory"]
    assert all(mem[c] == mem[c + "_formula"] for c in ("params", "grads", "optimizer")), mem
    assert "verdict: MATCH" in proc.stdout
