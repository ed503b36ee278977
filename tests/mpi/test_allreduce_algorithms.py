"""Recursive doubling and Rabenseifner: equal to MPI's Allreduce, bytes equal to their formulas,
and algorithm="auto" picks the same algorithm on every rank.

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_allreduce_algorithms.py

make test runs this at 1, 2, 3, 4 and 8 ranks; tests/test_allreduce_five_ranks.py runs it
at 5 (two ranks folded in, P = 4).

Equal to MPI's, how: sums that are exact in any order (integers, and floats holding small
integers) must be equal bit for bit; sums of random floats may round differently when MPI
adds in another order, so there the bound is max|ours - MPI's| <= 1e-12 max(max|MPI's|, 1)
in float64 (the inputs are of order 1; N of them summed in two orders differ by a few
units in the last place, about 1e-16 each). The order itself is checked exactly: both
algorithms add neighbours' arrays first, then pairs of pairs (tree_sum below).
"""
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import all_reduce, stats, tuning
from minidist.plan.collectives import (cheapest, formulas, power_of_two_below,
                                       rabenseifner_all_reduce_sent,
                                       recursive_doubling_all_reduce_sent)
from mpi_helpers import assert_same_on_all_ranks, inputs

pytestmark = pytest.mark.mpi

ALGORITHMS = ("recursive_doubling", "rabenseifner")
SENT = {"recursive_doubling": recursive_doubling_all_reduce_sent,
        "rabenseifner": rabenseifner_all_reduce_sent}
LENGTHS = (0, 1, 2, 3, 5, 8, 13, 1000, 4099)
RTOL = 1e-12


def mpi_sum(comm, x):
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=MPI.SUM)
    return out


def tree_sum(xs):
    """The order both algorithms add in: fold rank 2i+1 onto 2i for the first N-P pairs,
    then add neighbours, then neighbouring pairs, ... (a balanced tree over P arrays)."""
    n, p2 = len(xs), power_of_two_below(len(xs))
    extra = n - p2
    level = [xs[2 * i] + xs[2 * i + 1] for i in range(extra)] + list(xs[2 * extra:])
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_equal_to_mpi_bit_for_bit_when_the_sum_is_exact(comm, algorithm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for dtype in (np.int32, np.int64, np.float64):
        for n in LENGTHS:
            x = inputs(size, (n,), np.int64, seed=3)[rank].astype(dtype)   # small integers
            got = all_reduce(comm, x, algorithm=algorithm)
            want = mpi_sum(comm, x)
            assert got.dtype == want.dtype and np.array_equal(got, want), \
                f"{algorithm}, {np.dtype(dtype).name}, length {n}: differs from MPI's Allreduce"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_random_floats_equal_to_mpi_within_1e_12_and_in_the_stated_order(comm, algorithm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for n in LENGTHS:
        xs = inputs(size, (n,), np.float64, seed=4)
        got = all_reduce(comm, xs[rank], algorithm=algorithm)
        want = mpi_sum(comm, xs[rank])
        what = f"{algorithm}, float64, length {n} on {size} ranks"
        if n:
            scale = max(float(np.max(np.abs(want))), 1.0)
            assert float(np.max(np.abs(got - want))) <= RTOL * scale, \
                f"{what}: beyond 1e-12 of MPI's"
        assert np.array_equal(got, tree_sum(xs)), f"{what}: not added in the stated order"
        assert_same_on_all_ranks(comm, got, what)


def test_the_two_agree_bit_for_bit_in_every_op_and_shape(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for dtype in (np.float32, np.float64):
        for shape in ((), (7,), (3, 5, 2)):
            x = inputs(size, shape, dtype, seed=5)[rank]
            before = x.copy()
            for op in ("sum", "avg", "max"):
                a = all_reduce(comm, x, op=op, algorithm="recursive_doubling")
                b = all_reduce(comm, x, op=op, algorithm="rabenseifner")
                assert a.shape == x.shape and a.dtype == x.dtype
                assert np.array_equal(a, b), f"op {op}, shape {shape}: the two algorithms differ"
            assert np.array_equal(x, before), "the input was changed"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bytes_sent_by_every_rank_equal_the_formula(comm, algorithm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for n in LENGTHS:
        x = np.ones(n, np.float32)
        with stats.measure() as m:
            all_reduce(comm, x, algorithm=algorithm, check=False)
        want = SENT[algorithm](n, size, rank) * x.itemsize
        sent = m.bytes_sent("all_reduce")
        assert sent == want, f"{algorithm}, length {n}: rank {rank} sent {sent} B, formula {want} B"
        assert set(m) <= {"all_reduce"}, f"counted under {sorted(m)}, not only all_reduce"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_busiest_rank_sends_the_closed_form(comm, algorithm):
    """M divisible by P: recursive doubling (lg P + [N != P]) M,
    Rabenseifner 2(P-1)/P M + [N != P] M."""
    size = comm.Get_size()
    x = np.ones(8 * power_of_two_below(size) * 3, np.float64)
    with stats.measure() as m:
        all_reduce(comm, x, algorithm=algorithm, check=False)
    busiest = np.array([m.bytes_sent("all_reduce")])
    comm.Allreduce(MPI.IN_PLACE, busiest, op=MPI.MAX)
    label = f"all_reduce ({algorithm.replace('_', ' ')})"
    assert busiest[0] == formulas(size, x.nbytes)[label]


def test_auto_uses_rank_0s_constants_on_every_rank(comm, monkeypatch):
    """Each rank finds a different calibration file; all must pick by rank 0's."""
    size, rank = comm.Get_size(), comm.Get_rank()
    # rank 0: messages cost much (recursive doubling up to large sizes); others: bytes cost much
    mine = {"alpha": 1e-3, "beta": 1e-12, "gamma": 1e-12} if rank == 0 else \
           {"alpha": 1e-9, "beta": 1e-6, "gamma": 1e-6}
    folder = Path(tempfile.mkdtemp())       # one per rank (pytest's tmp_path races across ranks)
    monkeypatch.setenv(tuning.ENV, str(folder / "calibration.json"))
    tuning.save(mine, MPI.COMM_WORLD.Get_size())
    fresh = comm.Dup()                         # nothing agreed on it yet
    try:
        plan = tuning.agreed(fresh)
        want = {"alpha": 1e-3, "beta": 1e-12, "gamma": 1e-12}
        assert {k: plan[k] for k in want} == want, f"rank {rank} holds {plan}, not rank 0's"
        for nbytes in (8, 4096, 2**20, 2**26):
            picked = tuning.choose(fresh, nbytes)
            assert picked == cheapest(nbytes, size, **want)
            everyone = fresh.allgather(picked)
            assert len(set(everyone)) == 1, f"{nbytes} B: the ranks picked {everyone}"
        x = inputs(size, (33,), np.float64, seed=6)[rank]
        assert np.array_equal(all_reduce(fresh, x, algorithm="auto"),
                              all_reduce(fresh, x, algorithm=tuning.choose(fresh, x.nbytes)))
    finally:
        fresh.Free()
        shutil.rmtree(folder)


def test_auto_falls_back_to_the_defaults_when_nothing_is_stored(comm, monkeypatch):
    monkeypatch.setenv(tuning.ENV, "/nonexistent/minidist/calibration.json")
    fresh = comm.Dup()
    try:
        plan = tuning.agreed(fresh)
        assert {k: plan[k] for k in tuning.DEFAULTS} == tuning.DEFAULTS
        assert "defaults" in plan["source"]
    finally:
        fresh.Free()


def test_auto_with_inputs_that_disagree_names_the_input_not_the_algorithm(comm):
    """Sizes on both sides of a crossover would pick different algorithms: the check comes first."""
    from minidist.comm import MismatchError
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("a disagreement needs two ranks")
    x = np.ones(4 if rank else 2**20)
    try:
        all_reduce(comm, x, algorithm="auto")
        text = None
    except MismatchError as e:
        text = str(e)
    assert text is not None and "auto_all_reduce: ranks disagree on the input" in text, text
