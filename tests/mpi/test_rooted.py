"""Broadcast and reduce from every root, all-to-all, and point-to-point send/recv.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi/test_rooted.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import all_to_all, broadcast, recv, reduce, send
from mpi_helpers import DTYPES, assert_close, inputs, reference

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (2, 3), ()])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast_from_every_root(comm, shape, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = inputs(size, shape, dtype, seed=10)
    for root in range(size):
        before = xs[rank].copy()
        got = broadcast(comm, xs[rank], root=root)
        assert_close(got, xs[root], f"broadcast from root {root} to rank {rank}")
        assert np.array_equal(xs[rank], before), "broadcast changed its input"
        # non-roots need not have an array: the shape comes with the check
        got = broadcast(comm, xs[rank] if rank == root else None, root=root)
        assert_close(got, xs[root], f"broadcast from root {root} (x=None elsewhere) to rank {rank}")
        theirs = xs[rank].copy()
        comm.Bcast(theirs, root=root)
        assert_close(got, theirs, f"broadcast from root {root} beside MPI's Bcast")


@pytest.mark.parametrize("shape", [(0,), (1,), (9,), (3, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reduce_to_every_root(comm, shape, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = inputs(size, shape, dtype, seed=11)
    ops = ("sum", "avg", "max") if np.issubdtype(dtype, np.floating) else ("sum", "max")
    for root in range(size):
        for op in ops:
            got = reduce(comm, xs[rank], root=root, op=op)
            if rank == root:
                assert_close(got, reference(xs, op), f"reduce op={op} to root {root}")
            else:
                assert got is None, f"reduce to root {root}: rank {rank} should get None"


@pytest.mark.parametrize("rows,axis", [(0, 0), (1, 0), (5, 0), (12, 0), (4, 1), (9, 1)])
def test_all_to_all_sends_chunk_j_to_rank_j(comm, rows, axis):
    size, rank = comm.Get_size(), comm.Get_rank()
    shape = (rows, 3) if axis == 0 else (2, rows)
    xs = inputs(size, shape, np.float64, seed=12)
    before = xs[rank].copy()
    got = all_to_all(comm, xs[rank], axis=axis)
    want = np.concatenate([np.array_split(xs[i], size, axis=axis)[rank] for i in range(size)], axis=axis)
    assert_close(got, want, f"all_to_all rows={rows} axis={axis}: what rank {rank} received")
    assert np.array_equal(xs[rank], before), "all_to_all changed its input"


def test_all_to_all_with_different_lengths(comm):
    # expert parallelism routes a different number of tokens from each rank
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = [np.arange(10 * r, 10 * r + 2 * r + 1, dtype=np.int32) for r in range(size)]
    got = all_to_all(comm, xs[rank])
    want = np.concatenate([np.array_split(xs[i], size)[rank] for i in range(size)])
    assert_close(got, want, f"all_to_all of uneven lengths on rank {rank}")


def test_all_to_all_matches_mpi_own(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = inputs(size, (3 * size,), np.int64, seed=13)[rank]
    theirs = np.empty_like(x)
    comm.Alltoall(x, theirs)
    assert_close(all_to_all(comm, x), theirs, "all_to_all beside MPI's Alltoall")


def test_send_recv_around_the_ring(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("send/recv needs two ranks")
    right, left = (rank + 1) % size, (rank - 1) % size
    mine = np.full((2, rank + 1), rank, dtype=np.float32)
    # a token passes around the ring: rank 0 sends first, every other rank receives
    # first and then sends, so no two ranks ever wait on each other
    if rank == 0:
        send(comm, mine, right, tag=7)
        got = recv(comm, left, tag=7)
    else:
        got = recv(comm, left, tag=7)
        send(comm, mine, right, tag=7)
    assert_close(got, np.full((2, left + 1), left, dtype=np.float32), f"rank {rank} from rank {left}")


def test_send_recv_tags_in_range(comm):
    with pytest.raises(ValueError, match="tag"):
        send(comm, np.zeros(1), 0, tag=25000)


def test_send_refuses_what_it_cannot_describe_before_sending(comm):
    """A string array is refused on the sending rank, before any message leaves it."""
    rank = comm.Get_rank()
    for bad in (np.array(["ab"]), np.ones((1,) * 9)):
        with pytest.raises(ValueError, match="send: an array of shape"):
            send(comm, bad, dest=rank, tag=3)
    assert not comm.Iprobe(MPI.ANY_SOURCE, 3), "a refused send left a message behind"


def test_recv_refuses_a_message_that_is_not_a_send_header(comm):
    """A raw comm.Send on a user tag is not taken for minidist's header."""
    rank = comm.Get_rank()
    raw = np.zeros(16, np.int64)
    request = comm.Isend(raw, rank, 4)
    with pytest.raises(ValueError, match="not the header of a minidist send"):
        recv(comm, rank, tag=4)
    request.Wait()
