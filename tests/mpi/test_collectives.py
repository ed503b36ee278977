"""Each collective against one process's answer and against MPI's own, at any world size.

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_collectives.py

Lengths include zero, one, and fewer than the ranks; dtypes float and integer; every
axis; every op; and the input must come back unchanged.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import all_reduce, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from mpi_helpers import DTYPES, assert_close, assert_same_on_all_ranks, inputs, reference

pytestmark = pytest.mark.mpi

LENGTHS = (0, 1, 2, 3, 5, 8, 13)
SHAPES = [(n,) for n in LENGTHS] + [(), (2, 3), (3, 5, 2)]


def ops_for(dtype):
    return ("sum", "avg", "max") if np.issubdtype(dtype, np.floating) else ("sum", "max")


@pytest.mark.parametrize("impl", ["ring", "naive", "recursive_doubling", "mpi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_reduce_matches_one_process(comm, impl, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    for shape in SHAPES:
        xs = inputs(size, shape, dtype)
        x = xs[rank]
        before = x.copy()
        for op in ops_for(dtype):
            what = f"all_reduce impl={impl} op={op} shape={shape} {np.dtype(dtype).name} on rank {rank}"
            y = all_reduce(comm, x, op=op, impl=impl)
            assert_close(y, reference(xs, op), what)
            assert_same_on_all_ranks(comm, y, what)
            assert np.array_equal(x, before), f"{what}: the input was changed"
            assert not np.shares_memory(y, x), f"{what}: the result shares memory with the input"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_ring_all_reduce_matches_mpi_own(comm, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    for n in (0, 1, size - 1, 4 * size + 3, 1000):
        x = inputs(size, (n,), dtype, seed=1)[rank]
        for op, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX)):
            theirs = np.empty_like(x)
            comm.Allreduce(x, theirs, op=mpi_op)
            assert_close(ring_all_reduce(comm, x, op=op), theirs,
                         f"ring_all_reduce op={op} n={n} beside MPI's Allreduce")


def test_non_contiguous_input(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = inputs(size, (6, 4), np.float64, seed=2)
    ref = reference([a.T for a in xs], "sum")
    assert_close(ring_all_reduce(comm, xs[rank].T), ref, "ring_all_reduce of a transposed array")


@pytest.mark.parametrize("shape,axis", [((0,), 0), ((1,), 0), ((3,), 0), ((7,), 0), ((16,), 0),
                                        ((5, 3), 0), ((3, 5), 1), ((2, 3, 9), 2), ((2, 11, 3), 1),
                                        ((4, 2), -1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reduce_scatter_keeps_my_chunk(comm, shape, axis, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = inputs(size, shape, dtype, seed=3)
    before = xs[rank].copy()
    for op in ops_for(dtype):
        got = ring_reduce_scatter(comm, xs[rank], op=op, axis=axis)
        want = np.array_split(reference(xs, op), size, axis=axis)[rank]
        assert_close(got, want, f"ring_reduce_scatter op={op} shape={shape} axis={axis}: "
                                f"rank {rank}'s chunk {rank}")
    assert np.array_equal(xs[rank], before), "ring_reduce_scatter changed its input"


def test_reduce_scatter_matches_mpi_own(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = inputs(size, (10 * size + 3,), np.float64, seed=4)[rank]
    counts = [len(c) for c in np.array_split(x, size)]
    theirs = np.empty(counts[rank])
    comm.Reduce_scatter(x, theirs, counts, op=MPI.SUM)
    assert_close(ring_reduce_scatter(comm, x), theirs, "ring_reduce_scatter beside MPI's Reduce_scatter")


@pytest.mark.parametrize("shape,axis", [((0,), 0), ((1,), 0), ((5,), 0), ((3, 4), 0),
                                        ((3, 4), 1), ((2, 3, 4), 2), ((2, 3), -1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_gather_joins_in_rank_order(comm, shape, axis, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    whole = inputs(1, tuple(s * size + 1 for s in shape), dtype, seed=5)[0]   # uneven on purpose
    pieces = np.array_split(whole, size, axis=axis)
    # trim the other axes so only `axis` differs between pieces
    index = tuple(slice(None) if i == axis % len(shape) else slice(0, s) for i, s in enumerate(shape))
    pieces = [p[index] for p in pieces]
    before = pieces[rank].copy()
    got = ring_all_gather(comm, pieces[rank], axis=axis)
    assert_close(got, np.concatenate(pieces, axis=axis), f"ring_all_gather shape={shape} axis={axis}")
    assert np.array_equal(pieces[rank], before), "ring_all_gather changed its input"


def test_all_gather_matches_mpi_own(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    whole = np.arange(7 * size + 2, dtype=np.int64)
    pieces = np.array_split(whole, size)
    counts = [len(p) for p in pieces]
    theirs = np.empty(len(whole), np.int64)
    comm.Allgatherv(pieces[rank], [theirs, counts])
    assert_close(ring_all_gather(comm, pieces[rank]), theirs, "ring_all_gather beside MPI's Allgatherv")


def test_reduce_scatter_then_all_gather_is_all_reduce(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = inputs(size, (5 * size + 2,), np.float64, seed=6)[rank]
    two_step = ring_all_gather(comm, ring_reduce_scatter(comm, x))
    assert np.array_equal(two_step, ring_all_reduce(comm, x)), \
        "reduce-scatter + all-gather should give the ring all-reduce's very bits"
