"""Every lesson under the strict device double (MINIDIST_DEVICE=strict): it MATCHes one
process, it counts the bytes it moves between host and device, and every other figure it
reports (bytes on the wire, memory by category, bubbles) equals the CPU run's. And `make demo`
prints no line wider than 100 columns: lessons 00-09 run at their demo command's flags with a
small shape, so every section prints (10, 11 and 13 are held to 100 columns by their own
tests, whose runs print every line those lessons have).

One job per setting runs all the lessons (tests/strict_lessons.py): strict at 4 ranks beside
the CPU at 4 ranks, and strict on one process (with the planner, lesson 12).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "strict_lessons.py"
pytestmark = needs_mpirun

# what may differ between a CPU run and a strict one: how long things took and what is
# computed from it (lesson 01's alpha-beta fit and crossovers, lesson 04's measured bubble),
# and the transfers themselves (0 on the CPU)
TIMED = {"time", "s", "ms", "seconds", "mfu", "rate", "throughput", "alpha", "beta", "gamma",
         "crossovers", "idle"}
TIMED_KEYS = {"bubble_measured"}            # lesson 04: the bubble its ranks' clocks measured


def timed(key):
    """A key named for a time or a transfer, word by word ('generate_tokens' and
    'bytes_measured' are neither)."""
    words = set(key.lower().replace("->", "_").split("_"))
    return bool(words & TIMED) or key in TIMED_KEYS or "host_device_bytes" in key


def run_driver(n, device, tmp_path):
    out = tmp_path / f"{device}-{n}.json"
    env = dict(os.environ, MINIDIST_DEVICE=device, OMP_NUM_THREADS="1")
    proc = subprocess.run([*mpirun_cmd(n), sys.executable, str(DRIVER), str(out)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=HERE.parent)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def untimed(figures, path=""):
    """figures without the keys that time things or count transfers, flattened to paths."""
    flat = {}
    for key, value in figures.items():
        where = f"{path}/{key}"
        if timed(key):
            continue
        if isinstance(value, dict):
            flat.update(untimed(value, where))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):          # lesson 10's variants: one dict each
                flat.update(untimed(v, f"{where}[{i}]"))
        else:
            flat[where] = value
    return flat


@pytest.fixture(scope="module")
def strict4(tmp_path_factory):
    return run_driver(4, "strict", tmp_path_factory.mktemp("strict4"))


WIDTH = 100


def test_every_lesson_matches_under_the_double_at_4_ranks_and_counts_its_transfers(strict4):
    assert len(strict4) == 13, sorted(strict4)
    for lesson, got in strict4.items():
        assert got["match"], (lesson, got)
        assert len(got["widest"]) <= WIDTH, (lesson, len(got["widest"]), got["widest"])
        if lesson.startswith("01"):             # no steps: the bytes of each collective's call
            per_call = got["figures"]["host_device_bytes_per_call"]
            assert per_call and all(v > 0 for v in per_call.values()), per_call
        else:
            assert got["figures"].get("host_device_bytes_per_step", 0) > 0, (lesson, got["figures"])


def test_the_figures_under_the_double_equal_the_cpus(strict4, tmp_path):
    cpu = run_driver(4, "cpu", tmp_path)
    assert sorted(cpu) == sorted(strict4)
    for lesson in cpu:
        want, got = untimed(cpu[lesson]["figures"]), untimed(strict4[lesson]["figures"])
        assert sorted(got) == sorted(want), lesson
        moved = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
        assert not moved, (lesson, moved)


def test_every_lesson_matches_under_the_double_on_one_process(tmp_path):
    one = run_driver(1, "strict", tmp_path)
    assert len(one) == 14 and all(got["match"] for got in one.values()), one
    wide = {lesson: got["widest"] for lesson, got in one.items() if len(got["widest"]) > WIDTH}
    assert not wide, wide
