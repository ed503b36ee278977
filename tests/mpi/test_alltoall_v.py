"""all_to_all_v: chunks of any lengths, chunk j to rank j, against the gathered truth.

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_alltoall_v.py

Every rank builds every rank's chunks from one seed, so what rank r should receive
(chunk r of every rank, in rank order) needs no communication. Lengths include 0 and a
rank that sends nothing at all; the bytes counted under "all_to_all" must equal the
formula: the sum over destinations j != rank of my chunk j's bytes.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import MismatchError, all_to_all_v, ring_all_reduce, stats

pytestmark = pytest.mark.mpi


def all_chunks(size, rows, dtype, seed):
    """chunks[i][j]: what rank i sends rank j. Random lengths 0..4; the last rank sends nothing."""
    rng = np.random.default_rng([seed, size])
    lengths = rng.integers(0, 5, size=(size, size))
    lengths[size - 1, :] = 0                       # a rank with nothing to send
    if size > 1:
        lengths[0, 1] = 0                          # an empty chunk between two busy ranks
    return [[rng.standard_normal((int(lengths[i, j]),) + rows).astype(dtype) for j in range(size)]
            for i in range(size)]


@pytest.mark.parametrize("rows", [(3,), (2, 3)], ids=["2-D", "3-D"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_j_reaches_rank_j(comm, rows, dtype, seed):
    size, rank = comm.Get_size(), comm.Get_rank()
    chunks = all_chunks(size, rows, dtype, seed)
    mine = [c.copy() for c in chunks[rank]]
    with stats.measure() as m:
        got = all_to_all_v(comm, mine)
    assert len(got) == size, f"rank {rank}: {len(got)} arrays back, expected one per rank"
    for i in range(size):
        want = chunks[i][rank]
        assert got[i].shape == want.shape and got[i].dtype == want.dtype, \
            f"rank {rank}: from rank {i} got {got[i].shape} {got[i].dtype}, expected {want.shape} {want.dtype}"
        assert np.array_equal(got[i], want), f"rank {rank}: the rows from rank {i} differ"
        assert np.array_equal(mine[i], chunks[rank][i]), "all_to_all_v changed its input"
    sent = sum(chunks[rank][j].nbytes for j in range(size) if j != rank)
    recv = sum(chunks[i][rank].nbytes for i in range(size) if i != rank)
    assert m.bytes_sent("all_to_all") == sent, \
        f"rank {rank}: counted {m.bytes_sent('all_to_all')} bytes sent, formula {sent}"
    assert m.bytes_recv("all_to_all") == recv, \
        f"rank {rank}: counted {m.bytes_recv('all_to_all')} bytes received, formula {recv}"
    assert m.messages("all_to_all") == size - 1, "one data message per partner"
    assert m.messages("check") == 1 + (size - 1), "one descriptor all-gather, one count per partner"


def test_big_chunks_do_not_deadlock(comm):
    """Chunks far above MPI's eager limit, every rank to every rank at once."""
    size, rank = comm.Get_size(), comm.Get_rank()
    n = 40_000
    got = all_to_all_v(comm, [np.full((n + j, 4), rank * size + j, np.float64) for j in range(size)])
    for i in range(size):
        assert got[i].shape == (n + rank, 4) and np.all(got[i] == i * size + rank), \
            f"rank {rank}: the big chunk from rank {i} is wrong"


def _raised_on_every_rank(comm, call):
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


@pytest.mark.parametrize("what", ["dtype", "row shape"])
def test_ranks_that_disagree_fail_together(comm, what):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("a disagreement needs two ranks")
    last = rank == size - 1
    if what == "dtype":
        chunks = [np.zeros((2, 3), np.float32 if last else np.float64) for _ in range(size)]
    else:
        chunks = [np.zeros((2, 4 if last else 3)) for _ in range(size)]
    text = _raised_on_every_rank(comm, lambda: all_to_all_v(comm, chunks))
    assert "all_to_all_v" in text and f"rank {size - 1}" in text, f"the message should name the rank: {text}"


@pytest.mark.parametrize("what", ["chunk count", "rows within a rank"])
def test_a_rank_whose_chunks_disagree_fails_everywhere(comm, what):
    size, rank = comm.Get_size(), comm.Get_rank()
    if what == "rows within a rank" and size == 1:
        pytest.skip("one chunk cannot disagree with itself")
    chunks = [np.zeros((1, 3)) for _ in range(size)]
    if rank == 0:
        chunks = chunks + [np.zeros((1, 3))] if what == "chunk count" else \
            chunks[:-1] + [np.zeros((1, 2))]
    text = _raised_on_every_rank(comm, lambda: all_to_all_v(comm, chunks))
    assert "rank 0" in text, f"the message should name rank 0: {text}"
