"""`make demo` prints no line wider than 100 characters. The lessons' own lines (as each lesson
builds them: tables stacked or split, prose broken by hand) are held to it where every lesson
runs at its demo flags in one job, tests/test_strict_lessons.py; here, the wrapping net the
harness puts under them, and the commands make echoes."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100


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
