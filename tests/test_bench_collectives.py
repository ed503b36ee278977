"""`python -m minidist.bench collectives`: --calibrate stores the constants auto then uses,
--json writes the rows, bad input is refused in one line with exit status 2.

    python -m pytest -q tests/test_bench_collectives.py
"""
import json
import os
import subprocess
import sys

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun
from minidist.plan.collectives import cheapest

BENCH = [sys.executable, "-m", "minidist.bench", "collectives"]


def run(args, env, n=None, timeout=120):
    prefix = mpirun_cmd(n) if n else []
    return subprocess.run(prefix + BENCH + args, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env))


@needs_mpirun
def test_calibrate_then_the_table_picks_by_the_stored_constants(tmp_path):
    env = {"MINIDIST_CALIBRATION": str(tmp_path / "cal.json")}
    proc = run(["--calibrate"], env, n=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stored = json.loads((tmp_path / "cal.json").read_text())["by_world_size"]["2"]
    assert all(stored[k] >= 0 for k in ("alpha", "beta", "gamma")) and stored["alpha"] > 0
    assert "calibrated on 2 ranks" in proc.stdout and "auto at 2 ranks" in proc.stdout

    out = tmp_path / "rows.json"
    proc = run(["-b", "8", "-e", "1M", "-f", "32", "-n", "1", "-w", "0", "--crossovers",
                "--json", str(out)], env, n=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["size_bytes"] for r in rows] == [8, 256, 8192, 262144]
    for r in rows:
        assert {"size_bytes", "ring_us", "auto_us", "mpi_us", "auto_algorithm"} <= set(r)
        assert r["auto_algorithm"] == cheapest(r["size_bytes"], 2, stored["alpha"], stored["beta"],
                                               stored["gamma"])
    assert report["world_size"] == 2 and "cal.json" in report["constants"]["source"]
    text = proc.stdout
    assert "minidist ring" in text and "minidist auto" in text and "MPI Allreduce" in text
    assert "auto/MPI" in text and "recursive_doubling -> rabenseifner: model" in text
    assert "busbw in GB/s" in text and "(GB/s)" in text, "busbw's unit, in the text and the table"
    wide = [s for s in text.splitlines() if len(s) > 100 and str(tmp_path) not in s]   # but its path
    assert not wide, f"lines over 100 columns: {wide}"
    assert len([s for s in text.splitlines() if s.strip() and not s.startswith("#")]) == 4


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    env = {"MINIDIST_CALIBRATION": str(tmp_path / "cal.json")}
    for args, words in ((["-f", "1"], "need --factor >= 2"),
                        (["--calibrate"], "--calibrate needs two ranks or more"),
                        (["--json", str(tmp_path / "no" / "such" / "x.json")], "does not exist")):
        proc = run(args, env)                  # one process: MPI starts as a singleton
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0], (args, proc.stderr)
    assert not (tmp_path / "cal.json").exists()
