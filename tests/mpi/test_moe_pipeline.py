"""Mixture-of-experts blocks inside pipeline stages against one process ("Composes").

    mpirun -n 2 python -m pytest -q --only-mpi tests/mpi/test_moe_pipeline.py

p = the world size at 1 to 3 ranks; at 4, p = 2 x dp = 2. The MoE GPT (E = 4, top-2; capacity factor 1.0, which drops
tokens, or dropless), float64, three AdamW steps with clipping that really clips, under
1F1B, GPipe, interleaved (v = 2: 2p layers, 2p chunks) and ZB-H1. Each micro-batch is one
routing group, so the reference is the same GPT in one process with moe_groups = m. Per
tensor, the loss of each step (cross-entropy plus every MoE layer's balance and z losses,
whichever stage holds them), every raw gradient of each step (after the pipeline's sync,
before clipping) and every weight at the end: max_rel_diff <= 1e-10. A pipeline that
leaves out the aux losses of the stages before the last must fail the same comparison,
on the gradients as well as on the loss.
"""
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ProcessGrid, stats
from minidist import equivalence
from minidist.equivalence import mpi_reduce
from minidist.model import GPT, GPTConfig
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.pipeline_parallel import PipelineGPT, PipelineParallel, expected_p2p_bytes
from minidist.train import TrainConfig, get_lr, micro_batches, train_step

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() in (1, 3),
    reason="MoE in a pipeline runs at 2 ranks (2 stages) and 4 (2 stages x 2 replicas): 1 has no stage "
           "before the last, and 3 stages add nothing the dense pipeline tests do not")]

COMM = MPI.COMM_WORLD
WORLD = COMM.Get_size()
PP = WORLD if WORLD <= 3 else 2               # 4 ranks: pp 2 x dp 2, the data-parallel case
UP_TO_RANKS = 4
WHY = "1-3 stages and pp 2 x dp 2 at 4 ranks cover what pp 4 x dp 2 would, at a quarter of the cost"
T, SEED, STEPS, ROWS = 8, 5, 3, 2          # ROWS per micro-batch: a group of 16 tokens
TC = TrainConfig(max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
TOL = 1e-10


def config(n_layer=4, capacity_factor=1.0, moe_every=2, dropout=0.0, moe_z=0.0):
    return GPTConfig(block_size=T, vocab_size=64, n_layer=n_layer, n_head=2, n_embd=16, dropout=dropout,
                     dtype="float64", n_expert=4, top_k=2, capacity_factor=capacity_factor, moe_every=moe_every,
                     moe_alpha=0.1, moe_z=moe_z)


def batch(step, rows):
    g = np.random.default_rng([SEED, step])
    x = g.integers(0, 64, (rows, T))
    return x, np.roll(x, -1, axis=1)


def train(model, m, rows, dp=None, first=0, n=None, dropped=None):
    """STEPS steps on rows first..first+n of each batch; losses, raw grads of every step, weights."""
    opt = model.configure_optimizers(0.1, TC.learning_rate)
    losses, state = [], {}
    for step in range(STEPS):
        x, y = batch(step, rows)
        sl = slice(first, first + (n or rows))
        raw = {}
        loss, _ = train_step(model, opt, micro_batches(x[sl], y[sl], step, SEED, m, first_sample=first),
                             get_lr(step, TC), TC.grad_clip, dp=dp, raw_grads=raw)
        losses.append(loss)
        if dropped is not None:
            dropped.append(sum(s["dropped"] for s in model.moe_stats().values()))
        state.update({f"grad:{k}@step{step}": np.array(g) for k, g in raw.items()})
    state.update({f"weight:{k}": p.data.copy() for k, p in model.named_parameters()})
    return losses, state


def reference(cfg, m, rows, dropped=None):
    """One process, the whole batch at once, routed in m groups: one per micro-batch."""
    return train(GPT(replace(cfg, moe_groups=m), seed=SEED), 1, rows, dropped=dropped)


def pipeline(cfg, name, m, v=1, recompute="none"):
    grid = ProcessGrid(pp=PP)
    rows = m * ROWS * grid.dp
    # the same GPT as the reference's (moe_groups = m): a stage routes each micro-batch as one group
    model = PipelineGPT(GPT(replace(cfg, moe_groups=m * grid.dp), seed=SEED), PP, grid.pp_rank, v)
    model.set_recompute(recompute)
    dp = NaiveDataParallel(model, grid.dp_comm) if grid.dp > 1 else None    # world 4: pp 2 x dp 2
    runner = PipelineParallel(model, grid.pp_comm, name, m, dp)
    with stats.measure() as meas:
        losses, state = train(model, m, rows, runner, first=grid.dp_rank * m * ROWS, n=m * ROWS)
    return grid, model, runner, losses, state, meas, rows


def worst(cfg, name, m, v=1, loss=True, recompute="none"):
    """max_rel_diff over the losses, raw gradients and weights, the largest on any rank;
    the number of choices the reference's routers dropped over the three steps."""
    grid, model, runner, losses, state, meas, rows = pipeline(cfg, name, m, v, recompute)
    dropped = []
    ref_losses, ref_state = reference(cfg, m * grid.dp, rows, dropped)
    mine = {k: ref_state[k] for k in state}
    if loss:
        losses = mpi_reduce(grid.dp_comm, losses, "sum") / grid.dp
        state["loss"], mine["loss"] = np.array(losses), np.array(ref_losses)
    rel, _, where = equivalence.compare(state, mine)
    return mpi_reduce(COMM, rel), where, sum(dropped), (grid, model, runner, meas)


def skip_unless_fits(n_layer, v):
    if PP * v > n_layer:
        pytest.skip(f"{PP} x {v} virtual stages need at least that many layers, the model has {n_layer}")


CASES = [  # name, m, v, config: capacity (drops) and dropless, dropout and the z-loss in some
    ("1f1b", 4, 1, dict()),
    ("gpipe", 2, 1, dict()),
    # ZB-H1 with capacity: test_zb_h1_defers_the_routers_and_keeps_the_experts_in_b
    ("interleaved", PP, 2, dict(n_layer=2 * PP)),
    ("1f1b", 2, 1, dict(capacity_factor=None, moe_every=1, dropout=0.1, moe_z=1e-2)),
    ("zb-h1", 2, 1, dict(capacity_factor=None, moe_every=1, dropout=0.1, moe_z=1e-2)),
    ("interleaved", PP, 2, dict(n_layer=2 * PP, capacity_factor=None, dropout=0.1, moe_z=1e-2)),
    ("interleaved", 2 * PP, 2, dict(n_layer=2 * PP, moe_every=1, dropout=0.1, moe_z=1e-2)),
]


@pytest.mark.parametrize("name,m,v,kw", CASES,
                         ids=[f"{n}-m{m}-{'dropless' if k.get('capacity_factor', 1) is None else 'cf1'}"
                              f"-every{k.get('moe_every', 2)}{'-dropout' if k.get('dropout') else ''}"
                              for n, m, v, k in CASES])
def test_moe_pipeline_equals_one_process(name, m, v, kw):
    cfg = config(**kw)
    skip_unless_fits(cfg.n_layer, v)
    rel, where, dropped, (grid, model, runner, meas) = worst(cfg, name, m, v)
    assert rel <= TOL, f"{name}, p={PP}, v={v}, m={m}, {kw}: max_rel_diff {rel:.2e} (worst {where} on some rank)"
    if cfg.capacity_factor is None:
        assert dropped == 0, "dropless routing dropped a choice"
    else:
        assert dropped > 0, "capacity factor 1.0 dropped no choice: the capacity case is not exercised"
    # the aux losses add nothing point-to-point; the step's loss is one float64 all-reduce
    # over the pipeline group in place of the broadcast (beside the tied wte's sum on the
    # first and last rank and the clipping norm's, as without experts)
    assert meas.bytes_sent("send") // STEPS == expected_p2p_bytes(model, [ROWS] * m, 8)
    p, r = PP, grid.pp_rank
    assert "broadcast" not in meas, "the loss is all-reduced with the aux losses, not broadcast"
    if grid.dp == 1:                               # (data parallelism adds one per parameter)
        want = 1 + (p > 1) + (p > 1 and r in (0, p - 1))
        assert meas["all_reduce"]["calls"] == STEPS * want, (meas["all_reduce"], want)


@pytest.mark.skipif(PP < 2, reason="one stage holds every MoE layer: no stage before the last")
@pytest.mark.parametrize("name,m,v,kw", [("1f1b", 4, 1, dict()), ("interleaved", PP, 2, dict(n_layer=2 * PP))])
def test_leaving_out_a_non_last_stages_aux_loss_fails(name, m, v, kw, monkeypatch):
    """The bug peers make: only the last stage adds the balance loss. Gradients alone
    (the loss left out of the comparison) must show it."""
    chunk_aux = PipelineGPT.chunk_aux

    def last_only(self, c):
        return chunk_aux(self, c) if self.stages[c] == self.p * self.v - 1 else None

    monkeypatch.setattr(PipelineGPT, "chunk_aux", last_only)
    cfg = config(**kw)
    held = [s for s in range(PP * v - 1)
            for i in range(*PipelineGPT(GPT(cfg, seed=SEED), PP, 0, v).ranges[s]) if cfg.is_moe(i)]
    assert held, "no MoE block before the last stage: the test would prove nothing"
    rel, where, _, _ = worst(cfg, name, m, v, loss=False)
    assert rel > 1e-6, f"{name}, p={PP}: without the earlier stages' aux losses max_rel_diff is only {rel:.2e}"


def test_zb_h1_defers_the_routers_and_keeps_the_experts_in_b(monkeypatch):
    """ZB-H1's split with experts (every block MoE, capacity 1.0): the router's x @ W_router
    leaves W_router's gradient to W; the experts' stacked weights, used through indexing,
    get theirs in B; the run equals one process."""
    from minidist.parallel import pipeline_parallel
    in_w = set()
    run = pipeline_parallel.run_weight_grads

    def spy(later):
        in_w.update(id(t) for wg in later if wg.fn is not None for _, t in wg.params)
        run(later)

    monkeypatch.setattr(pipeline_parallel, "run_weight_grads", spy)
    rel, where, _, (grid, model, runner, meas) = worst(config(moe_every=1), "zb-h1", 4)
    assert rel <= TOL, f"zb-h1, p={PP}: max_rel_diff {rel:.2e} (worst {where})"
    params = dict(model.named_parameters())
    routers = [n for n in params if n.endswith("router.weight")]
    experts = [n for n in params if ".mlp.c_fc.weight" in n or ".mlp.c_proj.weight" in n]
    assert routers and experts
    assert all(id(params[n]) in in_w for n in routers), "a router's weight gradient was not left to W"
    assert not any(id(params[n]) in in_w for n in experts), "an expert's stacked weight went to W"


@pytest.mark.parametrize("policy", ["full", "every-k"])
def test_a_stage_refuses_recompute_that_would_drop_the_aux_gradients(policy):
    """As GPT.set_recompute: a checkpoint's forward runs without a graph, so the aux losses
    of the MoE blocks inside it would get no gradient. Selective recompute stays allowed."""
    stage = PipelineGPT(GPT(config(), seed=SEED), PP, COMM.Get_rank() % PP)
    with pytest.raises(ValueError, match="mixture of experts"):
        stage.set_recompute(policy)
    stage.set_recompute("selective")


def test_selective_recompute_with_moe_stages_equals_one_process():
    """The attention core recomputed in B (dropout on): the MoE blocks keep their graph."""
    rel, where, _, _ = worst(config(moe_every=1, dropout=0.1, moe_z=1e-2), "1f1b", 2, recompute="selective")
    assert rel <= TOL, f"selective recompute, p={PP}: max_rel_diff {rel:.2e} (worst {where})"
