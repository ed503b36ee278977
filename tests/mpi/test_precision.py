"""Mixed precision across ranks: 16-bit gradients travel and are summed in 16 bits (half
the bytes of fp32, measured), under data parallelism and ZeRO stages 1 and 2; the ranks
agree on an overflow and skip the same step; bfloat16 rides the hand-written collectives.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_precision.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ring_all_reduce, ring_reduce_scatter, stats
from minidist.model import GPT, GPTConfig
from minidist.parallel.compression import ring_bytes
from minidist.parallel.data_parallel import BucketedDataParallel
from minidist.plan.collectives import ring_all_gather_sent, ring_reduce_scatter_sent
from minidist.parallel.zero import ZeRO
from minidist.precision import GradScaler, MixedPrecision, autocast, dtype16
from minidist.train import micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 3
WHY = "the ring's bytes and the agreement are the same at 8; test_collectives.py runs the ring there"

COMM = MPI.COMM_WORLD
CFG = GPTConfig(block_size=8, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dtype="float32")
BF16 = dtype16("bf16")


def my_batch(step):
    rng = np.random.default_rng([step, COMM.Get_rank()])
    x = rng.integers(0, 256, (2, 8))
    return micro_batches(x, np.roll(x, -1, axis=1), step, 0, 1, 2 * COMM.Get_rank())


@pytest.mark.parametrize("dt", [BF16, np.dtype(np.float16)], ids=["bf16", "fp16"])
def test_16_bit_all_reduce_sums_exactly_where_the_values_allow_it(dt):
    n = 37                                             # no world size tested divides it
    x = (np.arange(n) % 7 + COMM.Get_rank()).astype(dt)   # small integers: every sum exact
    with stats.measure() as m:
        y = ring_all_reduce(COMM, x)
    size = COMM.Get_size()
    want = (np.arange(n) % 7) * size + size * (size - 1) // 2
    assert y.dtype == dt and np.array_equal(y.astype(np.float64), want)
    assert m.bytes_sent("all_reduce") == ring_bytes(n, size, COMM.Get_rank(), 2)
    part = ring_reduce_scatter(COMM, x)
    assert part.dtype == dt


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_data_parallel_reduces_16_bit_gradients_in_half_the_bytes(precision):
    sent = {}
    for reduce_dtype in (None, dtype16(precision)):
        model = GPT(CFG, seed=1)
        opt = MixedPrecision(model.configure_optimizers(0.1, 1e-3), model, precision)
        dp = BucketedDataParallel(model, COMM, reduce_dtype=reduce_dtype)
        scaler = GradScaler(init_scale=2.0 ** 8, comm=COMM) if precision == "fp16" else None
        with stats.measure() as m, autocast(precision):
            train_step(model, opt, my_batch(0), 1e-3, 1.0, dp=dp, scaler=scaler)
        sent[reduce_dtype is None] = m.bytes_sent("all_reduce")
        n = sum(p.size for p in model.parameters())
        itemsize = 4 if reduce_dtype is None else 2
        assert sent[reduce_dtype is None] == ring_bytes(n, COMM.Get_size(), COMM.Get_rank(), itemsize)
        if reduce_dtype is not None:
            assert all(b.flat.dtype == reduce_dtype for b in dp.buckets)
    assert 2 * sent[False] == sent[True]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_reduce_scatters_16_bit_gradients(stage):
    sent = {}
    for reduce_dtype in (None, BF16):
        model = GPT(CFG, seed=2)
        zero = ZeRO(model, model.configure_optimizers(0.1, 1e-3), COMM, stage, reduce_dtype=reduce_dtype)
        with stats.measure() as m, autocast("bf16"):
            train_step(model, zero, my_batch(0), 1e-3, 1.0, dp=zero)
        sent[reduce_dtype] = m.bytes_sent("reduce_scatter")
        want = sum(ring_reduce_scatter_sent(g.n, 1, COMM.Get_size(), COMM.Get_rank()) for g in zero.groups)
        assert sent[reduce_dtype] == want * (4 if reduce_dtype is None else 2)
        assert all(q.grad.dtype == np.float32 for g in zero.groups for q in g.pieces)   # back in fp32
        ag = sum(ring_all_gather_sent(g.n, 1, COMM.Get_size(), COMM.Get_rank()) for g in zero.groups) * 4
        assert m.bytes_sent("all_gather") == ag            # the fp32 weights still travel in fp32
    assert sent[None] == 2 * sent[BF16]


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    model = GPT(CFG, seed=3)
    zero = ZeRO(model, model.configure_optimizers(0.1, 1e-3), COMM, 1)
    scaler = GradScaler(init_scale=2.0 ** 4, comm=COMM)
    train_step(model, zero, my_batch(0), 1e-3, 0.0, dp=zero, scaler=scaler)
    before = [p.data.copy() for p in model.parameters()]
    # plant an inf in the last rank's partition only: every rank must skip
    original = zero.sync

    def poisoned():
        original()
        if COMM.Get_rank() == COMM.Get_size() - 1:
            zero.groups[0].pieces[-1].grad[...] = np.inf
    zero.sync = poisoned
    with np.errstate(invalid="ignore", over="ignore"):
        train_step(model, zero, my_batch(1), 1e-3, 0.0, dp=zero, scaler=scaler)
    assert scaler.found_inf and scaler.scale == 2.0 ** 3
    assert all(np.array_equal(a, p.data) for a, p in zip(before, model.parameters()))
