"""The all-reduce cost model (minidist/plan/collectives.py) and auto's crossovers, serially;
and the algorithms against MPI at 5 ranks, which make test's world sizes (1 2 3 4 8) skip.

    python -m pytest -q tests/test_allreduce_model.py
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun
from minidist.comm import tuning
from minidist.plan.collectives import (ALL_REDUCE_TIMES, all_reduce_times, cheapest, crossover,
                                       crossovers, formulas, power_of_two_below, rabenseifner_all_reduce_sent,
                                       recursive_doubling_all_reduce_sent, ring_all_reduce_sent)

ROOT = Path(__file__).resolve().parents[1]
WORLDS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
CONSTANTS = [dict(alpha=20e-6, beta=0.2e-9, gamma=0.1e-9), dict(alpha=1e-6, beta=1e-9, gamma=0.0),
             dict(alpha=300e-6, beta=2e-9, gamma=0.3e-9)]


@pytest.mark.parametrize("size", WORLDS)
def test_busiest_rank_sends_the_closed_form_when_p_divides(size):
    n = 24 * power_of_two_below(size) * size             # elements, divisible by N and by P
    got = formulas(size, n)                              # bytes, one-byte elements
    assert max(recursive_doubling_all_reduce_sent(n, size, r) for r in range(size)) == \
        got["all_reduce (recursive doubling)"]
    assert max(rabenseifner_all_reduce_sent(n, size, r) for r in range(size)) == \
        got["all_reduce (rabenseifner)"]
    assert max(ring_all_reduce_sent(n, size, r) for r in range(size)) == got["all_reduce (ring)"]


@pytest.mark.parametrize("size", WORLDS)
def test_rabenseifner_sends_each_chunk_it_does_not_own_once_each_way(size):
    """Uneven chunks too: every rank of the P sends, over both phases, 2 n minus its own
    chunk minus the one it is last given, which together is a whole power-of-two block."""
    p2 = power_of_two_below(size)
    for n in (0, 1, 3, 7, 100, 1001):
        total = sum(rabenseifner_all_reduce_sent(n, size, r) for r in range(size))
        folded = size - p2
        # in all, each of the P ranks gives away every chunk but its own once (n - own) and
        # sends what it holds back (n - own): 2(P n - n); the fold adds 2n per folded pair
        assert total == 2 * (p2 * n - n) + 2 * n * folded, (size, n)


@pytest.mark.parametrize("c", CONSTANTS)
@pytest.mark.parametrize("size", WORLDS[1:])
def test_the_plan_is_the_cheapest_algorithm_at_every_size(c, size):
    """crossovers() lists exactly the sizes where cheapest() changes, in order."""
    steps = crossovers(size, **c)
    for m in [2 ** k for k in range(3, 31)]:
        times = all_reduce_times(m, size, **c)
        best = cheapest(m, size, **c)
        assert times[best] == min(times.values())
        planned = cheapest(0, size, **c)
        for at, _, faster in steps:
            if m >= at:
                planned = faster
        assert planned == best, (m, planned, best)   # ties too (N = 2: ring = Rabenseifner)
    for at, slower, faster in steps:
        t = all_reduce_times(at, size, **c)
        assert t[slower] == pytest.approx(t[faster], rel=1e-9)


def test_power_of_two_worlds_never_leave_rabenseifner_for_the_ring():
    """Same bytes (2(N-1)/N M), fewer messages (2 lg N < 2(N-1)): in the model the ring never
    wins at N = 2^k. At N = 3 it does, from where the fold's extra bytes cost more."""
    for c in CONSTANTS:
        for size in (4, 8, 16):
            assert crossover("rabenseifner", "ring", size, **c) is None
        assert crossover("rabenseifner", "ring", 3, **c) is None   # the ring is faster throughout
        assert cheapest(2**30, 3, **c) == "ring"
    assert set(ALL_REDUCE_TIMES) == set(tuning.ALGORITHMS)


def test_measured_crossover_is_where_the_faster_one_changes_for_good():
    sizes = [8, 64, 512, 4096, 32768]
    at = tuning.measured_crossover(sizes, [1, 1, 1, 5, 9], [2, 2, 2, 3, 3])
    assert at == pytest.approx(512 + 3584 / 3)        # where the difference, a line, is 0
    assert tuning.measured_crossover(sizes, [1, 3, 1, 1, 9], [2, 2, 2, 2, 3]) > 4096   # not a blip
    assert tuning.measured_crossover(sizes, [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]) is None
    assert tuning.measured_crossover(sizes, [3, 3, 3, 3, 3], [2, 2, 2, 2, 2]) is None


def test_the_stored_calibration_is_read_back_and_the_nearest_world_size_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "sub" / "calibration.json"))
    assert tuning.load(4) == (tuning.DEFAULTS, "defaults (nothing stored)")
    tuning.save({"alpha": 1e-5, "beta": 2e-10, "gamma": 3e-10}, 2)
    tuning.save({"alpha": 4e-5, "beta": 5e-10, "gamma": 6e-10}, 8)
    assert tuning.load(3)[0] == {"alpha": 1e-5, "beta": 2e-10, "gamma": 3e-10}
    assert tuning.load(6)[0] == {"alpha": 4e-5, "beta": 5e-10, "gamma": 6e-10}
    (tmp_path / "sub" / "calibration.json").write_text("not json")
    constants, source = tuning.load(4)
    assert constants == tuning.DEFAULTS and "unreadable" in source


@needs_mpirun
def test_the_algorithms_against_mpi_at_five_ranks():
    """Five ranks: one folded pair, P = 4. The MPI tests of the algorithms, run at -n 5."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*mpirun_cmd(5), sys.executable, "-m", "pytest", "-q", "-p",
                           "no:cacheprovider", "--only-mpi", "tests/mpi/test_allreduce_algorithms.py"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0 and " passed" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
