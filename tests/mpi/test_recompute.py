"""Activation recomputation inside tensor parallelism, at whatever world size mpirun gives.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_recompute.py

The tensor-parallel GPT (t = the world, 24 heads) trains two AdamW steps with dropout
and clipping under each policy; its losses, raw gradients of every step and weights
(each rank's shards) must equal the same model's without recomputation to 1e-12. The
rerun repeats the forward's collectives: the bytes each rank sends equal
expected_bytes(recomputed_layers=L) for full and every-k (0 for selective, whose core
has no collective), with and without sequence parallelism. The meter's peak over the
blocks equals this engine's count for the policy at t ranks.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist import recompute
from minidist.comm import stats
from minidist import equivalence
from minidist.equivalence import mpi_reduce
from minidist.model import GPT, GPTConfig
from minidist.parallel.tp_formulas import expected_bytes
from minidist.plan.memory import recompute_peak_elements
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync
from minidist.rng import DropoutRNG
from minidist.tensor import MEMORY, Tensor
from minidist.train import TrainConfig, get_lr, micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "recomputation is per rank; inside tensor parallelism 2-4 ranks show the rerun's bytes"

COMM = MPI.COMM_WORLD
WORLD = COMM.Get_size()
B, T, L, SEED, STEPS = 4, 8, 3, 5, 2
TC = TrainConfig(batch_size=B, max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
CFG = GPTConfig(block_size=T, vocab_size=64, n_layer=L, n_head=24, n_embd=48, dropout=0.1, dtype="float64")


def _train(policy, sp=False):
    """(state {key: array}, bytes sent per collective over the run) of the TP model."""
    model = TensorParallelGPT(GPT(CFG, seed=SEED), COMM, sequence_parallel=sp).set_recompute(policy)
    opt = model.configure_optimizers(TC.weight_decay, TC.learning_rate)
    g = np.random.default_rng(SEED)
    state, sync = {}, TensorParallelSync(model)
    with stats.measure() as m:
        for step in range(STEPS):
            x = g.integers(0, CFG.vocab_size, (B, T))
            y = g.integers(0, CFG.vocab_size, (B, T))
            raw = {}
            loss, _ = train_step(model, opt, micro_batches(x, y, step, SEED), get_lr(step, TC), TC.grad_clip,
                                 dp=sync, raw_grads=raw)
            state[f"loss@{step}"] = np.array(loss)
            state.update({f"grad:{n}@{step}": g_ for n, g_ in raw.items()})
    state.update({f"weight:{n}": p.data.copy() for n, p in model.named_parameters()})
    sent = {name: m.bytes_sent(name) for name in ("all_reduce", "all_gather", "reduce_scatter")}
    return model, state, sent


@pytest.fixture(scope="module", params=[False, True], ids=["tp", "tp+sp"])
def reference(request):
    return request.param, _train("none", request.param)


@pytest.mark.parametrize("policy", ["full", "every-k", "selective"])
def test_each_policy_equals_no_recomputation_and_sends_the_rerun(reference, policy):
    sp, (_, ref_state, ref_sent) = reference
    model, state, sent = _train(policy, sp)
    rel, _, worst = equivalence.compare(state, ref_state)
    rel = mpi_reduce(COMM, rel)
    assert rel <= 1e-12, f"{policy} at t={WORLD}: max_rel_diff {rel:.2e} (this rank's worst: {worst})"
    again = 0 if policy == "selective" else L
    want = expected_bytes(model, B, T, clip=True, recomputed_layers=again)
    for name, (_, per_step) in want.items():
        assert sent[name] == STEPS * per_step, f"{policy}: {name} sent {sent[name]}, formula {STEPS * per_step}"
    if WORLD > 1 and again:
        assert sent["all_gather" if sp else "all_reduce"] > ref_sent["all_gather" if sp else "all_reduce"]


@pytest.mark.parametrize("policy", recompute.POLICIES)
def test_the_meter_peak_per_rank_equals_the_count(policy):
    model = TensorParallelGPT(GPT(CFG, seed=SEED), COMM).set_recompute(policy)
    g = np.random.default_rng(SEED)
    leaf = Tensor(g.standard_normal((B, T, CFG.n_embd)), requires_grad=True)
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    y = recompute.run_blocks(model.recompute, model.transformer.h, leaf.reshape(leaf.shape),
                             DropoutRNG(SEED, 0, range(B)), None)
    y.backward(g.standard_normal(y.shape))
    peak = MEMORY.peak_bytes - base
    count = recompute_peak_elements(policy, L, B, T, CFG.n_embd, CFG.n_head, t=WORLD, k=model.recompute.k) * 8
    bad = mpi_reduce(COMM, float(peak != count))
    assert bad == 0, f"{policy}: rank {COMM.Get_rank()} measured {peak}, count {count}"
