"""Lesson 00 on a terminal: one progress line that updates under the table with the time left
(minidist.progress); in a pipe, the table alone.

    python -m pytest -q tests/test_lesson00_progress.py

The terminal is a pseudo-terminal (pty): the lesson's stdout.isatty() is true there.
"""
import os
import pty
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--batch-size", "2",
         "--steps", "6", "--log-interval", "3", "--eval-interval", "0", "--sample-tokens", "0",
         "--peak-tflops", "1"]
CMD = [sys.executable, "-m", "minidist.lessons.00_single_process", *FLAGS]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def run_on_a_terminal():
    master, slave = pty.openpty()
    proc = subprocess.Popen(CMD, stdout=slave, stderr=subprocess.PIPE, cwd=ROOT, env=ENV)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:                     # EIO: the lesson closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    err = proc.communicate(timeout=120)[1]
    out = b"".join(chunks).decode().replace("\r\n", "\n")     # the pty writes each \n as \r\n
    return proc.returncode, out, err.decode()


def test_a_terminal_sees_one_updating_line_a_pipe_sees_the_table():
    code, out, err = run_on_a_terminal()
    assert code == 0, out[-2000:] + err[-2000:]
    updates = [piece for line in out.split("\n") for piece in line.split("\r") if piece.startswith("training")]
    assert any("left" in u for u in updates), f"no progress line with the time left: {updates}"
    assert any(u.startswith("training  6/6") and "done in" in u for u in updates), updates
    for step in ("    0  ", "    3  ", "    5  "):                   # the table's rows, each whole
        assert any(line.split("\r")[-1].startswith(step) for line in out.split("\n")), step
    assert all(len(piece.rstrip()) <= 100 for line in out.split("\n") for piece in line.split("\r"))

    piped = subprocess.run(CMD, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert piped.returncode == 0, piped.stdout[-2000:] + piped.stderr[-2000:]
    assert "\r" not in piped.stdout and "training" not in piped.stdout and "left" not in piped.stdout
    assert "    5  " in piped.stdout
