"""`make demo` prints no line wider than 100 characters: each lesson of the demo, at its demo
command's flags but a small shape and the fewest ranks that still print every section, with
the harness's wrapping net turned off (MINIDIST_NO_WRAP=1), so the lines checked are the ones
the lessons themselves build: tables stacked or split, prose broken by hand."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100
SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--batch-size", "8",
         "--steps", "2"]

# (lesson, ranks, flags): the Makefile's demo line, shrunk; 0 ranks: run without mpirun.
# Lessons 10, 11 and 13 are held to 100 columns by their own tests (test_lesson10.py,
# test_lesson11.py, test_lesson13.py), whose runs print every line those lessons have.
DEMO = [
    ("00_single_process", 0, SMALL + ["--sample-tokens", "20", "--eval-interval", "1", "--log-interval", "1",
                                      "--peak-tflops", "1"]),
    ("01_collectives", 4, ["--size-mib", "0.01", "--repeats", "1"]),
    ("02_data_parallel", 2, SMALL + ["--timing-reps", "1"]),
    ("03_tensor_parallel", 4, SMALL + ["--generate", "8"]),
    ("04_pipeline_parallel", 4, ["--schedule", "1f1b", "--micro-batches", "8", *SMALL[:-2], "--steps", "1",
                                 "--n-layer", "4"]),
    ("05_zero", 2, ["--stage", "all", *SMALL]),
    ("06_fsdp", 2, SMALL),
    ("07_3d_parallel", 4, ["--tp", "2", "--pp", "2", "--dp", "1", *SMALL[:-2], "--steps", "1", "--n-layer", "4"]),
    ("08_activation_recompute", 2, ["--tp", "2", *SMALL, "--sweep", "4,9"]),
    ("09_moe", 4, [*SMALL[:-4], "--batch-size", "12", "--steps", "2"]),
]


@pytest.mark.parametrize("lesson, n, flags", DEMO, ids=[d[0] for d in DEMO])
def test_demo_lines_fit_100_columns(lesson, n, flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIDIST_NO_WRAP="1")
    prefix = mpirun_cmd(n) if n else []
    proc = subprocess.run(prefix + [sys.executable, "-m", f"minidist.lessons.{lesson}", *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: MATCH" in proc.stdout, proc.stdout[-2000:]
    wide = [f"{len(line)}: {line}" for line in proc.stdout.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} lines wider than {WIDTH}:\n" + "\n".join(wide[:10])


def test_the_wrapping_net_keeps_words_and_indent():
    from minidist.cli import fit
    line = "  " + " ".join(f"word{i}" for i in range(40))
    out = fit(line)
    assert all(len(piece) <= WIDTH and piece.startswith("  ") for piece in out.splitlines())
    assert out.split() == line.split()
    assert fit("short\nlines") == "short\nlines"


def test_make_demo_echoes_no_command_wider_than_100():
    """make prints each demo command before it runs it: those lines count too."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["make", "-n", "demo", "PY=python", "MPIRUN=mpirun"], capture_output=True, text=True,
                          cwd=root, timeout=60)
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    wide = [l for l in lines if len(l.replace("python", ".venv/bin/python").replace("mpirun", ".venv/bin/mpirun")) > 100]
    assert not wide, wide
