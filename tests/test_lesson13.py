"""Lesson 13 (context parallelism) runs under mpirun, matches one process, holds its tiles and
bytes to plan/context.py's counts, prints no line wider than 100 columns; bad input exits 2
with one line on every rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]
LESSON = ["-m", "minidist.lessons.13_context_parallel"]
SMALL = ["--n-layer", "1", "--n-embd", "32", "--seq", "32", "--batch-size", "2", "--steps", "2",
         "--attn-block", "8", "--timing-reps", "1"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           MINIDIST_NO_WRAP="1")
KEYS = ("cp_bytes_measured", "cp_bytes_formula", "attention_blocks_per_rank",
        "activation_bytes_per_rank_measured", "activation_bytes_one_process_measured")


def run(n, *flags, tmp_path=None):
    out = tmp_path / "o.json" if tmp_path else None
    cmd = [*mpirun_cmd(n), sys.executable, *LESSON, *SMALL, *flags] + (["--json", str(out)] if out else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    return proc, (json.loads(out.read_text()) if out and proc.returncode == 0 else None)


def check(proc, rep, cp, variant):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: MATCH" in proc.stdout
    wide = [line for line in proc.stdout.splitlines() if len(line) > 100]
    assert not wide, "lines wider than 100 columns:\n" + "\n".join(wide)
    assert rep["match"] is True and rep["max_rel_diff"] <= 1e-10, rep["max_rel_diff"]
    assert rep["parallel"]["cp"] == cp and rep["parallel"]["variant"] == variant
    f = rep["figures"]
    assert all(f.get(k) is not None for k in KEYS), [k for k in KEYS if f.get(k) is None]
    assert f["cp_bytes_measured_per_rank"] == f["cp_bytes_formula_per_rank"]      # every rank, to the byte
    assert f["cp_bytes_measured"] == f["cp_bytes_formula"] > 0
    for split in ("balanced", "naive"):
        assert f[f"attention_tiles_per_rank_{split}"] == f[f"attention_tiles_formula_{split}"]
        assert f[f"attention_scores_per_rank_{split}"] == f[f"attention_scores_formula_{split}"]
    tiles = f["attention_blocks_per_rank"]
    assert len(tiles) == rep["world_size"]
    return f


@needs_mpirun
def test_ring_at_two_ranks_matches_and_the_zigzag_balances(tmp_path):
    proc, rep = run(2, tmp_path=tmp_path)
    f = check(proc, rep, 2, "ring")
    tiles = f["attention_tiles_per_rank_balanced"]
    assert len(set(tiles)) == 1, tiles           # --attn-block 8 divides the chunks of 32/4 = 8: equal
    naive = f["attention_scores_per_rank_naive"]
    assert max(naive) > 2 * min(naive), naive                        # about (2cp - 1) : 1 = 3 : 1
    assert f["cp_bytes_paper_formula"] == f["cp_bytes_formula"]      # 2cp divides s: the papers' count
    assert f["cp_bytes_paper_ring_gqa8"] * 8 == f["cp_bytes_paper_ring"]
    assert "ring_wait_s_overlap" in f and f["step_time_s_blockwise"] > 0


@needs_mpirun
def test_ulysses_at_three_ranks_with_uneven_chunks(tmp_path):
    """cp = 3: 6 chunks of 32 tokens (6, 6, 5, 5, 5, 5): the bytes follow the real lengths."""
    proc, rep = run(3, "--variant", "ulysses", "--n-head", "6", "--n-embd", "48", tmp_path=tmp_path)
    f = check(proc, rep, 3, "ulysses")
    assert len(set(f["attention_tiles_per_rank_balanced"])) == 1     # the whole sequence, cp's heads each


@needs_mpirun
def test_allgather_naive_split_with_dropout_at_three_ranks(tmp_path):
    proc, rep = run(3, "--variant", "allgather", "--no-load-balance", "--dropout", "0.1", tmp_path=tmp_path)
    f = check(proc, rep, 3, "allgather")
    assert rep["parallel"]["load_balance"] is False
    tiles = f["attention_blocks_per_rank"]                           # the naive split was trained
    assert tiles == f["attention_tiles_per_rank_naive"] and tiles[0] < tiles[-1]


@needs_mpirun
@pytest.mark.parametrize("n, flags, message", [
    (2, ["--variant", "zigzag"], "--variant ring"),
    (3, ["--variant", "ulysses"], "--n-head 6"),
    (2, ["--cp", "3"], "--cp"),
])
def test_bad_input_exits_2_with_one_line_and_a_command_that_works(n, flags, message):
    proc, _ = run(n, *flags)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "this works: mpirun" in lines[0], proc.stderr
    assert message in lines[0].split("this works:")[1], lines[0]
    assert "Lesson" not in proc.stdout and "Traceback" not in proc.stderr


def test_one_rank_counts_the_one_process_triangle(tmp_path):
    """cp = 1: the rank holds one range, (0, s), and attends it as one process does: seq 6
    in tiles of 2 is the triangle of 3 x 3 tiles, 6, beside plan/context.py's 6 (cutting at
    the two chunks' border made 10)."""
    out = tmp_path / "o.json"
    cmd = [sys.executable, *LESSON, "--cp", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq", "6",
           "--batch-size", "2", "--attn-block", "2", "--steps", "1", "--timing-reps", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert proc.returncode == 0 and "verdict: MATCH" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = json.loads(out.read_text())["figures"]
    for split in ("balanced", "naive"):
        assert f[f"attention_tiles_per_rank_{split}"] == f[f"attention_tiles_formula_{split}"] == [6]
