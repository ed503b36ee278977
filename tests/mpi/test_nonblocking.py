"""The non-blocking ring all-reduce gives the blocking ring's very bits, several at a time.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi/test_nonblocking.py
"""
import numpy as np
import pytest

from minidist.comm import MismatchError, ring_all_reduce, ring_all_reduce_start, stats
from mpi_helpers import assert_close, inputs, reference

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [0, 1, 3, 17, 1000])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_wait_equals_blocking(comm, n, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = inputs(size, (n,), np.float64, seed=20)
    before = xs[rank].copy()
    handle = ring_all_reduce_start(comm, xs[rank], op=op)
    got = handle.wait()
    assert np.array_equal(got, ring_all_reduce(comm, xs[rank], op=op)), \
        f"non-blocking op={op} n={n} differs from the blocking ring on rank {rank}"
    assert_close(got, reference(xs, op), f"non-blocking op={op} n={n}")
    assert np.array_equal(xs[rank], before), "the input was changed"
    assert handle.done and handle.t_end >= handle.t_start


def test_several_in_flight_with_interleaved_tests(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    shapes = [(5,), (3, 4), (64,), (0,), (2 * size + 1,), (7, 2)]
    xs = [inputs(size, s, np.float32, seed=21 + i) for i, s in enumerate(shapes)]
    handles = [ring_all_reduce_start(comm, x[rank]) for x in xs]
    # ranks poll in different orders, as ranks of a real job do
    order = list(range(len(handles)))
    np.random.default_rng(rank).shuffle(order)
    polls = 0
    while not all(h.done for h in handles):
        for i in order:
            handles[i].test()
        polls += 1
        assert polls < 100000, f"rank {rank}: the rings made no progress"
    for i, (h, x) in enumerate(zip(handles, xs)):
        assert np.array_equal(h.result, ring_all_reduce(comm, x[rank])), \
            f"all-reduce #{i} of shape {shapes[i]} differs from the blocking ring"


def test_wait_in_reverse_order(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = [inputs(size, (10 + i,), np.float64, seed=30 + i) for i in range(4)]
    handles = [ring_all_reduce_start(comm, x[rank]) for x in xs]
    for h, x in reversed(list(zip(handles, xs))):
        assert_close(h.wait(), reference(x, "sum"), "wait() in reverse order of start")


def test_counted_like_the_blocking_ring(comm):
    x = np.ones(4 * comm.Get_size() + 1, np.float32)
    with stats.measure() as blocking:
        ring_all_reduce(comm, x)
    with stats.measure() as background:
        ring_all_reduce_start(comm, x).wait()
    assert background["all_reduce"] == blocking["all_reduce"], \
        f"non-blocking counted {background['all_reduce']}, blocking {blocking['all_reduce']}"


def test_mismatch_found_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("a disagreement needs two ranks")
    handle = ring_all_reduce_start(comm, np.zeros(3 + comm.Get_rank()))
    with pytest.raises(MismatchError):
        handle.wait()


def test_several_communicators_with_different_calls_in_flight(comm):
    """Two groups of the world (even and odd ranks) run one and two background all-reduces,
    then one runs over the world while theirs are still in flight: each communicator counts
    its own tags, so the world's all-reduce has the same tag on every rank (a counter shared
    by all communicators would give the even and the odd ranks different ones: a deadlock)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("two groups need two ranks")
    # not freed: nonblocking keys its tag counters by the communicator's handle, which MPI
    # hands to the next communicator made after a Free (with this test's counters in it)
    group = comm.Split(rank % 2, rank)
    xs = [inputs(group.Get_size(), (5 + i,), np.float64, seed=40 + i) for i in range(1 + rank % 2)]
    mine = [ring_all_reduce_start(group, x[group.Get_rank()]) for x in xs]
    world_x = inputs(size, (7,), np.float64, seed=45)
    handle = ring_all_reduce_start(comm, world_x[rank])
    tags = np.empty(size, np.int64)
    comm.Allgather(np.array([handle.tag], np.int64), tags)
    assert len(set(tags.tolist())) == 1, f"the world's all-reduce has tags {tags.tolist()} on ranks 0..{size - 1}"
    assert_close(handle.wait(), reference(world_x, "sum"), "the world's all-reduce beside the groups'")
    for h, x in zip(mine, xs):
        assert_close(h.wait(), reference(x, "sum"), f"group {rank % 2}'s all-reduce")


def test_a_reduce_scatter_started_late_sends_its_first_phase_only(comm):
    """Rank 0 starts last, so its first test() (inside the start) finds its partners' first
    messages there and runs on as far as it can: it must stop after the reduce-scatter's
    N-1 steps, not go on into the all-reduce's all-gather steps (it once did, sending more
    bytes than (N-1)/N of the array, at random under Open MPI, every time here)."""
    import time

    from minidist.comm import ring_reduce_scatter
    from minidist.comm.nonblocking import ring_reduce_scatter_start
    n = comm.Get_size()
    x = np.arange(5 * n + 2, dtype=np.float64) * (comm.Get_rank() + 1)
    with stats.measure() as blocking:
        want = ring_reduce_scatter(comm, x)
    comm.Barrier()
    if comm.Get_rank() == 0:
        time.sleep(0.2)                       # the others' step-0 messages are waiting for rank 0
    with stats.measure() as background:
        got = ring_reduce_scatter_start(comm, x, check=False).wait()   # no check: the start runs test()
    comm.Barrier()
    assert np.array_equal(got, want)
    assert background["reduce_scatter"]["bytes_sent"] == blocking["reduce_scatter"]["bytes_sent"], \
        f"rank {comm.Get_rank()}: {background['reduce_scatter']} against the blocking ring's {blocking['reduce_scatter']}"
