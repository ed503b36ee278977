"""Bytes counted beside docs/reference.md's formulas, mismatches caught on every rank, agree().

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_counts_and_checks.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import (MismatchError, agree, all_reduce, all_to_all, broadcast, mpi_all_reduce,
                           ring_all_gather, ring_all_reduce, ring_all_reduce_start, ring_reduce_scatter,
                           stats)

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [0, 1, 5, 24, 24 * 7 + 5])
def test_ring_bytes_match_the_formula(comm, n):
    """2(N-1)/N * M for all-reduce, (N-1)/N * M for each half (docs/reference.md#ring-all-reduce)."""
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


# ----------------------------------------------------------------------------- edge cases

def _raised_on_every_rank(comm, call):
    """Run call(); return its MismatchError's text, after checking every rank raised one."""
    try:
        call()
        text = None
    except MismatchError as e:
        text = str(e)
    raised = np.array([int(text is not None)], np.int64)
    total = np.empty_like(raised)
    comm.Allreduce(raised, total, op=MPI.SUM)
    assert total[0] == comm.Get_size(), f"MismatchError on {total[0]} of {comm.Get_size()} ranks"
    assert ring_all_reduce(comm, np.ones(3))[0] == comm.Get_size(), "something was left in flight"
    return text


def _mismatched_algorithms(comm, r):
    return all_reduce(comm, np.ones(4), impl="ring" if r == 0 else "naive")


@pytest.mark.parametrize("name,call,words", [
    ("ring, naive", _mismatched_algorithms, ("ring_all_reduce", "naive_all_reduce")),
    ("all-reduce, broadcast",
     lambda comm, r: ring_all_reduce(comm, np.ones(4)) if r else broadcast(comm, np.ones(4)),
     ("ring_all_reduce", "broadcast")),
    ("gather, scatter",
     lambda comm, r: ring_all_gather(comm, np.ones(4)) if r else ring_reduce_scatter(comm, np.ones(4)),
     ("ring_all_gather", "ring_reduce_scatter")),
    ("mpi, recursive doubling",
     lambda comm, r: all_reduce(comm, np.ones(4), impl="mpi" if r else "recursive_doubling"),
     ("mpi_all_reduce", "recursive_doubling_all_reduce")),
])
def test_ranks_calling_different_collectives_is_a_mismatch(comm, name, call, words):
    if comm.Get_size() == 1:
        pytest.skip("a disagreement needs two ranks")
    text = _raised_on_every_rank(comm, lambda: call(comm, comm.Get_rank()))
    assert text.startswith("ranks called different collectives"), text
    for w in words:
        assert w in text, f"{name}: {w!r} not in {text!r}"


UNCHECKED = {
    "ring": lambda comm, x, op: ring_all_reduce(comm, x, op=op, check=False),
    "naive": lambda comm, x, op: all_reduce(comm, x, op=op, impl="naive", check=False),
    "doubling": lambda comm, x, op: all_reduce(comm, x, op=op, impl="recursive_doubling", check=False),
    "mpi": lambda comm, x, op: all_reduce(comm, x, op=op, impl="mpi", check=False),
    "mpi_all_reduce": lambda comm, x, op: mpi_all_reduce(comm, x, op=op),
    "reduce_scatter": lambda comm, x, op: ring_reduce_scatter(comm, x, op=op, check=False),
    "start": lambda comm, x, op: ring_all_reduce_start(comm, x, op=op, check=False).wait(),
}


@pytest.mark.parametrize("impl", sorted(UNCHECKED))
def test_unknown_op_and_integer_avg_are_refused_without_check(comm, impl):
    """op="min" once summed silently with check=False, and MPI floored an integer avg."""
    call = UNCHECKED[impl]
    text = _raised_on_every_rank(comm, lambda: call(comm, np.ones(6), "min"))
    assert "the op must be one of sum, avg, max" in text, text
    text = _raised_on_every_rank(comm, lambda: call(comm, np.arange(6), "avg"))
    assert "op 'avg' needs a float or complex array" in text, text


BAD_DTYPES = {"string": np.array(["ab", "cd"]), "bytes": np.array([b"ab", b"cd"]),
              "record": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
              "byte-swapped": np.zeros(2, dtype=np.dtype(np.float64).newbyteorder()),
              "object": np.array([1, "a"], dtype=object)}


@pytest.mark.parametrize("kind", sorted(BAD_DTYPES))
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast", "all_to_all"])
def test_dtypes_mpi_cannot_carry_are_refused_on_every_rank(comm, kind, collective):
    """Only the last rank passes the bad array: every rank raises, none crashes."""
    size, rank = comm.Get_size(), comm.Get_rank()
    x = BAD_DTYPES[kind] if rank == size - 1 else np.zeros(2)
    call = {"all_reduce": lambda: ring_all_reduce(comm, x),
            "all_gather": lambda: ring_all_gather(comm, x),
            "broadcast": lambda: broadcast(comm, x, root=size - 1),
            "all_to_all": lambda: all_to_all(comm, x)}[collective]
    text = _raised_on_every_rank(comm, call)
    assert f"rank {size - 1} passed" in text and "MPI cannot carry this dtype" in text, text


def test_more_dimensions_than_the_check_holds_are_refused(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    deep = np.ones((1,) * 8 + (2, 3))
    text = _raised_on_every_rank(comm, lambda: ring_all_reduce(comm, deep if rank == 0 else np.ones(6)))
    assert "rank 0 passed" in text and "at most 8 dimensions" in text, text
    # without the check the ring needs no shape: a deep array keeps its shape
    y = ring_all_reduce(comm, deep, check=False)
    assert y.shape == deep.shape and np.all(y == size)
    # eight dimensions fit, and a mismatch in the last one is seen
    eight = np.ones((1,) * 6 + (2, 3 + (rank == size - 1)))
    if size > 1:
        text = _raised_on_every_rank(comm, lambda: ring_all_reduce(comm, eight))
        assert "disagree on the input" in text, text
    x = np.ones((1,) * 6 + (2, 3))
    assert broadcast(comm, x if rank == 0 else None).shape == x.shape


@pytest.mark.parametrize("impl", ["ring", "naive", "recursive_doubling", "mpi"])
def test_complex_sum_and_avg(comm, impl):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = [np.arange(5) * (r + 1) + 1j * r for r in range(size)]
    total = np.sum(xs, axis=0)
    assert np.allclose(all_reduce(comm, xs[rank], op="sum", impl=impl), total)
    assert np.allclose(all_reduce(comm, xs[rank], op="avg", impl=impl), total / size)
    text = _raised_on_every_rank(comm, lambda: all_reduce(comm, xs[rank], op="max", impl=impl))
    assert "complex numbers have no order" in text, text
