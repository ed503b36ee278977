"""Bytes counted beside REFERENCE.md's formulas, mismatches caught on every rank, agree().

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_counts_and_checks.py
"""
import numpy as np
import pytest

from minidist.comm import (MismatchError, agree, all_reduce, broadcast, ring_all_gather,
                           ring_all_reduce, ring_reduce_scatter, stats)

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [0, 1, 5, 24, 24 * 7 + 5])
def test_ring_bytes_match_the_formula(comm, n):
    """2(N-1)/N * M for all-reduce, (N-1)/N * M for each half (REFERENCE.md)."""
    size = comm.Get_size()
    x = np.ones(n, np.float32)
    M, item = x.nbytes, x.itemsize
    formula = {"all_reduce": 2 * (size - 1) * M / size, "reduce_scatter": (size - 1) * M / size,
               "all_gather": (size - 1) * M / size}
    steps = {"all_reduce": 2 * (size - 1), "reduce_scatter": size - 1, "all_gather": size - 1}
    with stats.measure() as m:
        ring_all_reduce(comm, x)
        ring_reduce_scatter(comm, x)
        ring_all_gather(comm, np.array_split(x, size)[comm.Get_rank()])
    for name, want in formula.items():
        sent = m.bytes_sent(name)
        slack = 0 if n % size == 0 else steps[name] * item     # one element per chunk sent
        assert abs(sent - want) <= slack, \
            f"{name} of {M} bytes on {size} ranks sent {sent} bytes, formula says {want:.1f}"
        assert m.messages(name) == steps[name], \
            f"{name} sent {m.messages(name)} messages, expected {steps[name]}"
        assert m[name]["calls"] == 1, f"{name} was counted as {m[name]['calls']} calls"
    assert "check" in m and m.bytes_sent("check") > 0, "the shape checks should be counted apart"


def test_check_bytes_are_apart_from_data(comm):
    x = np.ones(8, np.float64)
    with stats.measure() as checked:
        ring_all_reduce(comm, x)
    with stats.measure() as unchecked:
        ring_all_reduce(comm, x, check=False)
    assert checked["all_reduce"] == unchecked["all_reduce"], "checks leaked into the data bytes"
    assert "check" not in unchecked


def test_reset_and_snapshot(comm):
    ring_all_reduce(comm, np.ones(4))
    stats.reset()
    assert stats.snapshot() == {}, "reset() should forget every count"
    ring_all_reduce(comm, np.ones(4))
    snap = stats.snapshot()
    assert snap["all_reduce"]["calls"] == 1


@pytest.mark.parametrize("name,call", [
    ("length", lambda comm, r: ring_all_reduce(comm, np.zeros(3 + (r == comm.Get_size() - 1)))),
    ("dtype", lambda comm, r: all_reduce(comm, np.zeros(3, np.float32 if r else np.float64))),
    ("naive length", lambda comm, r: all_reduce(comm, np.zeros(2 + r), impl="naive")),
    ("op", lambda comm, r: ring_all_reduce(comm, np.zeros(3), op="sum" if r else "max")),
    ("avg of ints", lambda comm, r: ring_all_reduce(comm, np.zeros(3, np.int32), op="avg")),
    ("unknown op", lambda comm, r: ring_all_reduce(comm, np.zeros(3), op="mean")),
    ("gather other dims", lambda comm, r: ring_all_gather(comm, np.zeros((2, 3 + r)))),
    ("scatter axis", lambda comm, r: ring_reduce_scatter(comm, np.zeros((2, 2)), axis=r % 2)),
    ("broadcast root", lambda comm, r: broadcast(comm, np.zeros(2), root=r % 2)),
    ("root out of range", lambda comm, r: broadcast(comm, np.zeros(2), root=comm.Get_size())),
])
def test_mismatch_raises_on_every_rank(comm, name, call):
    size, rank = comm.Get_size(), comm.Get_rank()
    needs_two = name in ("length", "dtype", "naive length", "op", "gather other dims",
                         "scatter axis", "broadcast root")
    if needs_two and size == 1:
        pytest.skip("a disagreement needs two ranks")
    with pytest.raises(MismatchError) as err:
        call(comm, rank)
    assert "rank" in str(err.value), f"the message should name the rank: {err.value}"
    # and nothing is left in flight: the next collective works
    assert ring_all_reduce(comm, np.ones(3))[0] == size


def test_agree(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    assert agree(comm, True) is True
    assert agree(comm, rank != size - 1) is False, "one rank said no: no rank may say yes"
    with stats.measure() as m:
        agree(comm, True)
    assert set(m) == {"check"}, f"agree should count only under 'check', got {sorted(m)}"
