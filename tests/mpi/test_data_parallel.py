"""Data parallelism against one process, at whatever world size mpirun gives (1, 2, 3, 4, 8).

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_data_parallel.py

float64, 3 AdamW steps with gradient clipping that really clips: max_rel_diff (per
tensor, over loss, every gradient and every weight) at most 1e-10, naive and bucketed,
with and without gradient accumulation, with and without dropout.
"""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import stats
from minidist.data import Dataset, default_corpus, shard_slice
from minidist.lessons import common, harness
from minidist.model import GPT, GPTConfig
from minidist.parallel.data_parallel import (BucketedDataParallel, NaiveDataParallel,
                                             broadcast_parameters, replica_checksums)
from minidist.train import TrainConfig

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
BATCH = 48  # divides by every world size tested (1, 2, 3, 4, 8) times 2 accumulation steps
DATA = Dataset.from_text(default_corpus()[:20_000], block_size=8, seed=5)


def train(dtype="float64", dp=None, accum=1, dropout=0.0, bucket_bytes=2048, steps=3, clip=0.05):
    """For one configuration: (max_rel_diff against one process, replica CRCs, the
    synchroniser, all-reduce bytes this rank sent per step)."""
    cfg = GPTConfig(block_size=8, vocab_size=256, n_layer=2, n_head=2, n_embd=16, dropout=dropout, dtype=dtype)
    args = SimpleNamespace(steps=steps, batch_size=BATCH, seed=7)
    tc = TrainConfig(batch_size=BATCH, max_iters=steps, learning_rate=3e-3, warmup_iters=1, grad_clip=clip)

    def fresh():
        model = GPT(cfg, seed=11)
        return model, model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))

    ref_model, ref_opt = fresh()
    ref_losses, ref_state, _ = common.train_and_collect(ref_model, ref_opt, DATA, args, tc)
    model, opt = fresh()
    sync = None
    if dp == "naive":
        sync = NaiveDataParallel(model, COMM)
    elif dp == "bucketed":
        sync = BucketedDataParallel(model, COMM, bucket_bytes=bucket_bytes)
    rows = shard_slice(BATCH, COMM.Get_rank(), COMM.Get_size(), accum)
    with stats.measure() as m:
        losses, state, _ = common.train_and_collect(model, opt, DATA, args, tc, rows, accum, sync)
    state["loss"] = common.mpi_reduce(COMM, losses, "sum") / COMM.Get_size()
    ref_state["loss"] = np.array(ref_losses)
    rel, _, _ = harness.compare(state, ref_state)
    return common.mpi_reduce(COMM, rel), replica_checksums(model, COMM), sync, m.bytes_sent("all_reduce") / steps


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("mode", ["naive", "bucketed"])
def test_float64_matches_one_process(mode, accum, dropout):
    rel, crcs, _, _ = train(dp=mode, accum=accum, dropout=dropout)
    assert rel <= 1e-10, f"{mode}, accumulation {accum}, dropout {dropout}: max_rel_diff {rel:.2e} > 1e-10"
    assert len(set(crcs.tolist())) == 1, f"replicas differ after training: CRCs {crcs.tolist()}"


def test_without_sync_the_ranks_drift_apart():
    """The test can fail: skip the all-reduce and, on several ranks, it must."""
    rel, crcs, _, _ = train(dp=None)
    if COMM.Get_size() > 1:
        assert rel > 1e-6 and len(set(crcs.tolist())) > 1
    else:
        assert rel <= 1e-10


@pytest.mark.parametrize("bucket_bytes", [1, 10**9])
def test_any_bucket_size_matches(bucket_bytes):
    """One parameter per bucket, and everything in one bucket."""
    rel, _, dp, _ = train(dp="bucketed", bucket_bytes=bucket_bytes)
    n_params = len(dp.params)
    assert len(dp.buckets) == (n_params if bucket_bytes == 1 else 1)
    assert rel <= 1e-10


def test_float32_within_stated_tolerance():
    rel, crcs, _, _ = train(dtype="float32", dp="bucketed", accum=2, dropout=0.1)
    assert rel <= harness.TOLERANCE["float32"], f"float32 max_rel_diff {rel:.2e}"
    assert len(set(crcs.tolist())) == 1


def test_buckets_start_during_backward_in_reverse_parameter_order():
    """Overlap is structural: every bucket but the last is posted before backward ends."""
    _, _, dp, _ = train(dp="bucketed", steps=1)
    tl = dp.timeline
    names = [dp.names[id(p)] for b in dp.buckets for p in b.params]
    assert names == [n for n, _ in dp.model.named_parameters()][::-1]
    assert len(dp.buckets) > 2
    starts = [t_start for _, _, _, t_start, _ in tl["buckets"]]
    assert starts == sorted(starts)
    assert all(t < tl["backward_end"] for t in starts[:-1]), "buckets should start while backward runs"


def test_bytes_per_step_match_the_ring_formula():
    _, _, dp, sent = train(dp="bucketed", bucket_bytes=10**9, steps=1)  # one bucket of M bytes
    n, m_bytes = COMM.Get_size(), dp.buckets[0].nbytes
    itemsize = dp.buckets[0].flat.itemsize
    expected = 2 * (n - 1) * m_bytes / n
    # 2(N-1) chunks sent, each array_split chunk within one element of M/N
    assert abs(sent - expected) <= 2 * (n - 1) * itemsize, f"sent {sent} B, formula {expected:.0f} B"
    if (m_bytes // itemsize) % n == 0:
        assert sent == expected


def test_replicas_start_identical_after_broadcast():
    cfg = GPTConfig(block_size=8, vocab_size=256, n_layer=1, n_head=2, n_embd=8, dtype="float64")
    model = GPT(cfg, seed=100 + COMM.Get_rank())  # a different start on every rank
    broadcast_parameters(model, COMM, root=0)
    assert len(set(replica_checksums(model, COMM).tolist())) == 1


def test_a_batch_that_does_not_divide_is_a_clear_error_on_every_rank():
    n = COMM.Get_size()
    if n == 1:
        pytest.skip("every batch divides by one rank")
    with pytest.raises(ValueError, match=f"multiple of {n}"):
        shard_slice(n * 3 + 1, COMM.Get_rank(), n)
