"""The link model (minidist/comm/links.py) under MPI: each message is charged to the link
it crosses, counted per link class against what the collectives send; a wrapped
communicator (and one split from it) gives the very same bits as the plain one.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi/test_links.py

Counts, never wall-clock times: the delays are made tiny (a huge bandwidth)."""
import numpy as np
import pytest

from minidist.comm import links, ring_all_reduce, send, recv
from minidist.comm.checks import DESC_LEN
from minidist.plan.collectives import ring_all_reduce_sent

pytestmark = pytest.mark.mpi

UP_TO_RANKS = 4
WHY = "the link model's counts need two simulated nodes, which 2 and 4 ranks give; 8 adds only time"

ALPHA, BW, SCALE = 1e-7, 1e12, 3.0        # a message waits 0.1 us + a few ns per KB


def model(size, wait="sleep"):
    """Two simulated nodes (one rank each at 2 ranks, two each at 4)."""
    return links.Links(2, size // 2, (ALPHA, BW), (2 * ALPHA, BW / 8), SCALE, wait)


def expect_ring(lk, world_ranks, me, n, itemsize=8):
    """{class: [messages, bytes]} a ring all-reduce of n sends from `me` over world_ranks."""
    size = len(world_ranks)
    i = world_ranks.index(me)
    out = {"intra": [0, 0], "inter": [0, 0]}
    if size > 1:
        cls = lk.link(me, world_ranks[(i + 1) % size])
        out[cls] = [2 * (size - 1), ring_all_reduce_sent(n, size, i) * itemsize]
    return out


def counted(lk):
    return {c: v[:2] for c, v in lk.counts.items()}


@pytest.mark.parametrize("wait", links.WAITS)
def test_ring_all_reduce_is_charged_to_its_links_and_bits_do_not_change(comm, wait):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size % 2:
        pytest.skip("two simulated nodes need an even world")
    lk = model(size, wait)
    wrapped = links.wrap(comm, lk)
    for n in (0, 1, size + 1, 1000):
        x = np.random.default_rng(rank * 7 + n).standard_normal(n)
        lk.reset()
        got = ring_all_reduce(wrapped, x)
        assert np.array_equal(got, ring_all_reduce(comm, x)), f"n={n}: the wrapped ring differs"
        want = expect_ring(lk, list(range(size)), rank, n)
        assert counted(lk) == want, f"rank {rank}, n={n}: counted {counted(lk)}, sent {want}"
        seconds = sum(lk.links[c][0] * m + b * SCALE / lk.links[c][1]
                      for c, (m, b) in want.items())
        assert lk.counts["intra"][2] + lk.counts["inter"][2] == pytest.approx(seconds, rel=1e-12)


def test_split_communicators_are_wrapped_and_charged_by_world_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size % 2:
        pytest.skip("two simulated nodes need an even world")
    lk = model(size)
    wrapped = links.wrap(comm, lk)
    sub = wrapped.Split(rank % 2, rank)             # even and odd world ranks
    plain = comm.Split(rank % 2, rank)
    try:
        assert isinstance(sub, links.LinkedComm), "Split of a wrapped communicator must be wrapped"
        members = [r for r in range(size) if r % 2 == rank % 2]
        x = np.random.default_rng(rank).standard_normal(37)
        lk.reset()
        assert np.array_equal(ring_all_reduce(sub, x), ring_all_reduce(plain, x))
        assert counted(lk) == expect_ring(lk, members, rank, 37), \
            f"rank {rank}: a sub-communicator's message goes to the world rank it names"
    finally:
        sub.Free()
        plain.Free()


def test_point_to_point_pair_counts_header_and_data(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size % 2:
        pytest.skip("two simulated nodes need an even world")
    lk = model(size)
    wrapped = links.wrap(comm, lk)
    partner = size - 1 - rank                       # 0 <-> last: always across the two nodes
    x = np.arange(10, dtype=np.float32) + rank
    lk.reset()
    if rank < partner:
        send(wrapped, x, partner)
        got = recv(wrapped, partner)
    else:
        got = recv(wrapped, partner)
        send(wrapped, x, partner)
    assert np.array_equal(got, np.arange(10, dtype=np.float32) + partner)
    assert lk.counts["intra"][:2] == [0, 0], f"rank {rank} to {partner} is not inside a node"
    assert lk.counts["inter"][:2] == [2, DESC_LEN * 8 + x.nbytes], \
        f"send is a header of {DESC_LEN} int64 and the data: {lk.counts['inter']}"


def test_lesson07_step_is_timed_under_the_link_model(comm):
    """measure.time_layout runs lesson 07's step on a wrapped world: every rank returns the
    same positive time, and the pipeline's and ZeRO's messages were charged to links."""
    from minidist.lessons import plan_measure as measure
    size = comm.Get_size()
    if size % 2:
        pytest.skip("two simulated nodes need an even world")
    shape = dict(n_layer=2, n_head=2, n_embd=8, block_size=4, batch_size=2 * size, dtype="float64")
    lk = model(size)
    took, m = measure.time_layout(links.wrap(comm, lk), 1, 2, size // 2, shape, steps=1, warmup=0)
    everyone = np.empty(size)
    comm.Allgather(np.array([took]), everyone)
    assert took > 0 and np.all(everyone == took), f"step times differ between ranks: {everyone}"
    sent = np.array([lk.counts[c][0] for c in ("intra", "inter")], dtype=np.int64)
    total = np.empty_like(sent)
    comm.Allreduce(sent, total)
    # the pipeline's boundary (ranks 2k, 2k+1) lies inside a node at 4 ranks; the dp groups
    # (rank r and r + 2) span the two nodes; at 2 ranks each node holds one rank
    want_intra = size > 2
    assert m >= 1 and total[1] > 0 and (total[0] > 0) == want_intra, \
        f"messages charged (intra, inter) over all ranks: {total}"


@pytest.mark.mpi(min_size=2)
def test_lesson_12_measure_counts_the_planners_bytes_on_each_layout():
    """plan_measure's byte column: lesson 07 at each layout (2 ranks: all; 4: those with two
    groups larger than one), its counters against Estimate.bytes_sent for the rank the
    planner speaks for, group by group, exactly."""
    from mpi4py import MPI
    from minidist.lessons import plan_measure as measure
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    chosen = [f for f in measure.factorisations(size) if size == 2 or sorted(f)[1] > 1]
    cluster = measure.one_node(measure.cpu_cluster(1e9, 1e9, links.Links(1, size, (0.0, 1e9)), 0.0, 4,
                                                   size, 1.0))
    for tp, pp, dp in chosen:
        if measure.layout_problem(tp, pp, dp, measure.SHAPE, size):
            continue
        sent = {}
        _, m = measure.time_layout(comm, tp, pp, dp, measure.SHAPE, 1, 0, sent=sent)
        planned, counted = measure.bytes_row(measure.predict(cluster, tp, pp, dp, m, measure.SHAPE, "fp32"),
                                             sent)
        assert planned == counted, (tp, pp, dp, planned, counted)
        assert sum(counted.values()) > 0
