"""Experts with tensor parallelism ("composes"): TP 2 x EP 2 at 4 ranks, TP 2 x EP 1 at 2.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi/test_moe_tensor_parallel.py
    mpirun -n 2 python -m pytest -q --only-mpi tests/mpi/test_moe_tensor_parallel.py

A ProcessGrid with tp = 2 and dp = world / 2. The dense parts (attention, the dense MLP
of block 0, embeddings, head) are cut as TensorParallelGPT cuts them; the MoE block's
router and experts act whole on the replicated ln_2 output, the experts spread over an
ep group = the dp group of each TP rank (ep = dp: each dp rank's tokens one routing
group). The one-process reference is the same MoE GPT with moe_groups = dp over the same
global batch. float64, 3 AdamW steps with clipping that clips: the losses, the clipping
norms, the raw gradients of every step (synchronised, before clipping; TP shards gathered
under the one-process names; an expert tensor compared with the reference's slice of the
experts this rank holds) and the weights at the end: max_rel_diff <= 1e-10 per tensor.

Negative controls: summing the expert (or router) gradients over the TP pair, which each
TP rank already holds whole, must break the comparison.
"""
import functools

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ProcessGrid, all_reduce
from minidist.data import shard_slice
from minidist import equivalence
from minidist.equivalence import mpi_reduce
from minidist.model import GPT, GPTConfig
from minidist.parallel.expert_parallel import ExpertParallel, ExpertParallelMoE, expert_parallel
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync, TPError, gather_state
from minidist.train import TrainConfig, get_lr, micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "TP 2 x EP 2 is the largest case the issue asks for"

COMM = MPI.COMM_WORLD
WORLD = COMM.Get_size()
TP = 2
BATCH, T, V, SEED, STEPS = 8, 8, 256, 7, 3
TC = TrainConfig(batch_size=BATCH, max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
EXPERT_PARTS = (".mlp.c_fc.", ".mlp.c_proj.")

needs_tp_pairs = pytest.mark.skipif(WORLD not in (2, 4), reason=f"TP 2 x EP (world / 2) runs at 2 or 4 ranks, "
                                                                 f"not {WORLD}")


def config(E, top_k, capacity_factor, dropout=0.0, moe_every=2, groups=1):
    return GPTConfig(block_size=T, vocab_size=V, n_layer=2, n_head=2, n_embd=8, dropout=dropout, dtype="float64",
                     n_expert=E, top_k=top_k, capacity_factor=capacity_factor, moe_every=moe_every,
                     moe_groups=groups, moe_alpha=0.01, moe_z=0.001)


def batch(step):
    g = np.random.default_rng([SEED, step])
    return g.integers(0, V, (BATCH, T)), g.integers(0, V, (BATCH, T))


def adamw(model):
    return model.configure_optimizers(TC.weight_decay, TC.learning_rate, (TC.beta1, TC.beta2))


def train(model, opt, sync, rows):
    """STEPS steps on rows `rows` of each global batch: (losses, [raw grads per step], norms)."""
    losses, raws, norms = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        mb = micro_batches(x[rows], y[rows], step, SEED, 1, first_sample=rows.start or 0)
        raw = {}
        loss, norm = train_step(model, opt, mb, get_lr(step, TC), TC.grad_clip, dp=sync, raw_grads=raw)
        losses.append(loss)
        raws.append(raw)
        norms.append(norm)
    return losses, raws, norms


@functools.lru_cache(maxsize=None)
def reference(cfg_key):
    """One process over the whole batch, moe_groups = dp routing groups (no messages)."""
    model = GPT(config(*cfg_key), seed=SEED)
    losses, raws, norms = train(model, adamw(model), None, slice(None))
    state = {"loss": np.array(losses), "norm": np.array(norms)}
    for step, raw in enumerate(raws):
        state.update({f"grad{step}:{n}": g for n, g in raw.items()})
    state.update({f"weight:{n}": p.data.copy() for n, p in model.named_parameters()})
    return state


def run(E, top_k, capacity_factor, dropout=0.0, moe_every=2, ep_size=None):
    """TP 2 x EP (world / 2): (max_rel_diff over the world, worst here, the sync, the model, grid).
    ep_size: an ep group smaller than dp (dp / ep_size copies of each expert); None: ep = dp."""
    grid = ProcessGrid(tp=TP)
    key = (E, top_k, capacity_factor, dropout, moe_every, grid.dp)
    model = TensorParallelGPT(GPT(config(*key), seed=SEED), grid.tp_comm)
    ep_comm = grid.dp_comm if ep_size is None else grid.dp_comm.Split(grid.dp_rank // ep_size, grid.dp_rank)
    ep = expert_parallel(model, ep_comm, grid.dp_comm)            # tp rank i's ep group: in dp group i
    sync = TensorParallelSync(model, dp=ep)
    rows = shard_slice(BATCH, grid.dp_rank, grid.dp)
    losses, raws, norms = train(model, adamw(model), sync, rows)  # optimizer after the swap
    assert min(norms) > TC.grad_clip, f"clipping must really clip: norms {norms}"
    state = {"loss": mpi_reduce(grid.dp_comm, losses, "sum") / grid.dp, "norm": np.array(norms)}
    for step, raw in enumerate(raws):
        state.update(gather_state(model, raw, prefix=f"grad{step}:"))
    state.update(gather_state(model, prefix="weight:"))
    lo, hi = ep.layers[0][1].lo, ep.layers[0][1].hi                  # the same experts in every layer
    moe = tuple(f".h.{i}{part}" for i, _ in ep.layers for part in EXPERT_PARTS)
    ref = {k: (v[lo:hi] if any(m in k for m in moe) else v) for k, v in reference(key).items()}
    assert set(state) == set(ref), "the parallel run should report every tensor the reference does"
    rel, _, worst = equivalence.compare(state, ref)
    return mpi_reduce(COMM, rel), worst, ep, model, grid


CASES = [  # (E, top_k, capacity factor, dropout, moe_every)
    (4, 2, 1.0, 0.0, 2),
    (4, 1, 1.0, 0.1, 2),
    (4, 2, None, 0.0, 2),
    ("2ep", 1, 1.0, 0.0, 2),
    ("2ep", 2, None, 0.1, 1),
]


def _E(E, grid_dp):
    return 2 * grid_dp if E == "2ep" else E


@needs_tp_pairs
@pytest.mark.parametrize("E,top_k,capacity_factor,dropout,moe_every", CASES,
                         ids=lambda v: "dropless" if v is None else str(v))
def test_float64_matches_one_process(E, top_k, capacity_factor, dropout, moe_every):
    dp = WORLD // TP
    E = _E(E, dp)
    rel, worst, ep, model, grid = run(E, top_k, capacity_factor, dropout, moe_every)
    what = f"TP {TP} x EP {grid.dp}, E={E}, top-{top_k}, capacity {capacity_factor}, dropout {dropout}"
    assert rel <= 1e-10, f"{what}: max_rel_diff {rel:.2e} > 1e-10 (worst on this rank: {worst})"
    assert all(isinstance(m, ExpertParallelMoE) and m.hi - m.lo == E // grid.dp for _, m in ep.layers)
    assert ep.expert_dp_comm is None, "ep = dp: nobody else holds my experts"
    dropped = mpi_reduce(COMM, sum(d for step in ep.history for _, d in step.values()), "sum")
    if capacity_factor is None:
        assert dropped == 0, f"{what}: dropless routing dropped {dropped} choices"
    else:
        assert dropped > 0, f"{what}: capacity 1.0 should drop some choices in {STEPS} steps"
    # the MoE block's MLP stayed whole on both TP ranks; the dense ones are cut
    for i, b in enumerate(model.transformer.h):
        assert b.moe == model.config.is_moe(i)
    assert all(f"transformer.h.{i}.mlp.c_fc.weight" not in model.specs for i, _ in ep.layers)
    if moe_every == 2:
        assert "transformer.h.0.mlp.c_fc.weight" in model.specs


def _sum_over_tp(which):
    """A wrong sync: after the right one, also sum `which` gradients over the TP pair."""
    right = ExpertParallel.sync

    def wrong(self):
        right(self)
        tp_comm = self.model.comm
        for name, p in self.model.named_parameters():
            if (which == "experts" and id(p) in {id(q) for q in self.expert_params}) or \
                    (which == "router" and name.endswith("mlp.router.weight")):
                p.grad = all_reduce(tp_comm, p.grad, op="sum")
    return wrong


@needs_tp_pairs
@pytest.mark.parametrize("which", ["experts", "router"])
def test_summing_over_the_tp_pair_is_caught(monkeypatch, which):
    """Each TP rank holds the whole gradient of the router and its experts: summing it over
    the pair doubles it, and the comparison must say so (a test that cannot fail is none)."""
    monkeypatch.setattr(ExpertParallel, "sync", _sum_over_tp(which))
    rel, worst, *_ = run(4, 2, 1.0)
    assert rel > 1e-6, f"doubling the {which}' gradients went unnoticed: max_rel_diff {rel:.2e}"


@pytest.mark.skipif(WORLD != 4, reason="TP 2 x dp 2 with ep 1 needs 4 ranks")
def test_ep_inside_data_parallel():
    """TP 2 x dp 2 with ep groups of 1: each expert held by both replicas of a TP rank, its
    gradient summed over those two (not over the TP pair) and divided by dp."""
    rel, worst, ep, _, _ = run(4, 2, 1.0, ep_size=1)
    assert ep.expert_dp_comm is not None and ep.expert_dp_comm.Get_size() == 2
    assert rel <= 1e-10, f"TP 2 x dp 2 x ep 1: max_rel_diff {rel:.2e} > 1e-10 ({worst})"


@needs_tp_pairs
def test_the_norm_counts_each_expert_once(monkeypatch):
    """Clipping with each expert counted on both TP ranks (the norm summed over the pair too)
    must break the comparison: the norms are compared, and clipping really clips."""
    right = ExpertParallel.expert_grad_norm_sq
    monkeypatch.setattr(ExpertParallel, "expert_grad_norm_sq",
                        lambda self, params: 2 * right(self, params))
    rel, *_ = run(4, 2, 1.0)
    assert rel > 1e-6, f"an expert counted twice in the norm went unnoticed: {rel:.2e}"


def test_sequence_parallel_with_moe_is_refused():
    comm = MPI.COMM_SELF
    with pytest.raises(TPError, match="sequence parallelism with mixture of experts"):
        TensorParallelGPT(GPT(config(4, 2, 1.0), seed=SEED), comm, sequence_parallel=True)
