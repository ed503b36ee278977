"""Expert parallelism against one process, at whatever world size mpirun gives (1-4).

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi/test_expert_parallel.py

float64, 3 AdamW steps with clipping that clips: the losses, the raw gradients of every
step (synchronised, before clipping) and the weights after training, within 1e-10
(max_rel_diff per tensor) of one process running the same MoE GPT over the same global
batch with moe_groups = the world size (each rank's tokens are one routing group). A
rank holds experts [lo, hi): its expert tensors are compared with that slice of the
reference's. Top-1 and top-2; capacity factor 1.0 (0.5 where top_k = E: every token
then picks every expert and 1.0 drops nothing), tokens dropped, checked; and None
(dropless, checked); E = 2 x world and E = world; dropout 0.1 on the layer's output
(moe.py draws it per sample and position, so wherever a token's expert runs, the mask
is the single process's). The all-to-all bytes each rank sends equal the formula.
"""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import stats
from minidist.data import Dataset, default_corpus, shard_slice
from minidist import equivalence
from minidist.model import GPT, GPTConfig
from minidist.parallel.expert_parallel import ExpertParallelMoE, expert_parallel
from minidist.plan.traffic import moe_sent
from minidist.train import TrainConfig

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "E = 8 over 4 ranks is the largest case the issue asks for; every rank does the same"

COMM = MPI.COMM_WORLD
BATCH, STEPS = 12, 3           # 12 sequences divide by 1, 2, 3 and 4 ranks
DATA = Dataset.from_text(default_corpus()[:20_000], block_size=8, seed=5)
EXPERT_PARTS = (".mlp.c_fc.", ".mlp.c_proj.")   # attention has a c_proj too
_REFERENCES = {}


def config(n_expert, top_k, capacity_factor, groups, dropout=0.1):
    return GPTConfig(block_size=8, vocab_size=256, n_layer=2, n_head=2, n_embd=8, dropout=dropout,
                     dtype="float64", n_expert=n_expert, top_k=top_k, capacity_factor=capacity_factor,
                     moe_every=1, moe_groups=groups, moe_alpha=0.01, moe_z=0.001)


def setup(cfg):
    args = SimpleNamespace(steps=STEPS, batch_size=BATCH, seed=7)
    tc = TrainConfig(batch_size=BATCH, max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
    return args, tc


def optimizer(model, tc):
    return model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))


def reference(cfg):
    """One process, the whole batch, moe_groups routing groups: (losses, state), kept per config."""
    key = (cfg.n_expert, cfg.top_k, cfg.capacity_factor, cfg.moe_groups, cfg.dropout)
    if key not in _REFERENCES:
        args, tc = setup(cfg)
        model = GPT(cfg, seed=11)
        losses, state, _ = equivalence.train_and_collect(model, optimizer(model, tc), DATA, args, tc)
        state["loss"] = np.array(losses)
        _REFERENCES[key] = state
    return _REFERENCES[key]


def train(cfg, ep_comm=COMM):
    """Train expert-parallel; return (max_rel_diff over ranks, the sync object, bytes measured)."""
    args, tc = setup(cfg)
    model = GPT(cfg, seed=11)
    ep = expert_parallel(model, ep_comm, COMM)
    opt = optimizer(model, tc)                     # after the swap: the expert Parameters are new
    rows = shard_slice(BATCH, COMM.Get_rank(), COMM.Get_size())
    with stats.measure() as m:
        losses, state, _ = equivalence.train_and_collect(model, opt, DATA, args, tc, rows, 1, ep)
    state["loss"] = equivalence.mpi_reduce(COMM, losses, "sum") / COMM.Get_size()
    lo, hi = ep.layers[0][1].lo, ep.layers[0][1].hi
    ref = {k: (v[lo:hi] if any(p in k for p in EXPERT_PARTS) else v) for k, v in reference(cfg).items()}
    rel, _, worst = equivalence.compare(state, ref)
    assert set(state) == set(ref), "the parallel run should report every tensor the reference does"
    return SimpleNamespace(rel=equivalence.mpi_reduce(COMM, rel), worst=worst, ep=ep, measured=m)


def cases():
    n = COMM.Get_size()
    out = []
    for E in (2 * n, n):
        for top_k in (1, 2):
            # every token picks every expert when top_k = E: only a factor below 1 drops then
            for cf in (1.0 if top_k < E else 0.5, None):
                if top_k <= E:
                    out.append((E, top_k, cf))
    return out


@pytest.mark.parametrize("E,top_k,capacity_factor", cases(),
                         ids=lambda v: "dropless" if v is None else str(v))
def test_float64_matches_one_process(E, top_k, capacity_factor):
    n = COMM.Get_size()
    r = train(config(E, top_k, capacity_factor, groups=n))
    what = f"E={E} over {n} ranks, top-{top_k}, capacity factor {capacity_factor}"
    assert r.rel <= 1e-10, f"{what}: max_rel_diff {r.rel:.2e} > 1e-10 (worst here: {r.worst})"
    assert all(isinstance(b.mlp, ExpertParallelMoE) for b in r.ep.model.transformer.h)
    assert all(m.hi - m.lo == E // n for _, m in r.ep.layers), "each rank holds E/ep experts"
    dropped = equivalence.mpi_reduce(COMM, sum(d for step in r.ep.history for _, d in step.values()), "sum")
    if capacity_factor is None:
        assert dropped == 0, f"{what}: dropless routing dropped {dropped} choices"
    else:
        assert dropped > 0, f"{what}: this capacity factor should drop some choices in 3 steps"


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_to_all_bytes_match_the_formula(top_k):
    """Per MoE layer per step each rank sends 2 x (rows to other ranks + rows from other
    ranks) x C x itemsize: dispatch and combine, forward and backward."""
    n, rank = COMM.Get_size(), COMM.Get_rank()
    cfg = config(2 * n, top_k, 1.0, groups=n)
    r = train(cfg)
    ep, C, itemsize = r.ep, cfg.n_embd, 8
    expected = 0
    for step in ep.history:
        for i, (local, _) in step.items():
            layer = dict(ep.layers)[i]
            total = np.empty_like(local)
            COMM.Allreduce(local, total, op=MPI.SUM)
            mine = slice(layer.lo, layer.hi)
            to_others = local.sum() - local[mine].sum()          # my kept choices for other ranks' experts
            from_others = total[mine].sum() - local[mine].sum()  # other ranks' choices for mine
            expected += moe_sent(to_others, from_others, C, itemsize)
    measured = r.measured.bytes_sent("all_to_all")
    assert measured == expected, f"rank {rank}: all-to-all sent {measured} B, formula {expected} B"
    calls = [len(m.comm_bytes) for _, m in ep.layers]
    assert calls == [4 * STEPS] * len(ep.layers), f"4 all-to-alls per MoE layer per step, got {calls}"
    logged = sum(b for _, m in ep.layers for _, b, f in m.comm_bytes)
    assert logged == measured and all(b == f for _, m in ep.layers for _, b, f in m.comm_bytes)
    if n > 1:
        assert equivalence.mpi_reduce(COMM, measured, "sum") > 0, "tokens should travel between ranks"
    counters = ep.counters()
    assert set(counters) == {i for i, _ in ep.layers}
    for c in counters.values():
        assert c["tokens_per_expert_total"].sum() == equivalence.mpi_reduce(COMM, c["tokens_per_expert"].sum(), "sum")


def test_ep_inside_data_parallel():
    """world = dp_outer x ep: ep = 2 at 4 ranks, ep = 1 at 2; the expert gradients are
    averaged over the dp_outer copies of the same experts."""
    n = COMM.Get_size()
    if n not in (2, 4):
        pytest.skip("dp_outer x ep needs 2 or 4 ranks here")
    ep_size = n // 2
    ep_comm = COMM.Split(color=COMM.Get_rank() // ep_size, key=COMM.Get_rank())
    r = train(config(4, 2, 1.0, groups=n), ep_comm)
    assert r.ep.expert_dp_comm.Get_size() == 2
    assert r.rel <= 1e-10, f"dp_outer 2 x ep {ep_size}: max_rel_diff {r.rel:.2e} > 1e-10 ({r.worst})"
    ep_comm.Free()


def test_experts_that_do_not_divide_are_refused():
    n = COMM.Get_size()
    if n == 1:
        pytest.skip("every E divides over one rank")
    model = GPT(config(n + 1, 1, 1.0, groups=n), seed=11)
    with pytest.raises(ValueError, match=f"E = {n + 1} is not a multiple of the ep size {n}"):
        expert_parallel(model, COMM)


def test_a_rank_whose_experts_get_no_tokens():
    """Every token to expert 0: the other ranks receive no rows, run no expert, and still
    take part in all four all-to-alls; one layer's output and gradients equal one process's."""
    from minidist.moe import MoEMLP
    from minidist.nn import Parameter
    from minidist.tensor import Tensor
    n, rank = COMM.Get_size(), COMM.Get_rank()
    ref = MoEMLP(config(2 * n, 1, None, groups=n, dropout=0.0))
    rng = np.random.default_rng(0)
    for p in ref.parameters():
        p.data[...] = rng.standard_normal(p.data.shape) * 0.3
    ref.router.weight.data[:, 0] += 5.0            # with positive inputs, expert 0 wins every token
    x, g = np.abs(rng.standard_normal((2 * n, 3, 8))), rng.standard_normal((2 * n, 3, 8))
    xr = Parameter(x.copy())
    yr = ref(xr)
    ((yr * Tensor(g)).sum() + ref.aux["balance"]).backward()
    layer = ExpertParallelMoE(ref, COMM)
    mine = slice(2 * rank, 2 * rank + 2)
    xl = Parameter(x[mine].copy())
    yl = layer(xl)
    ((yl * Tensor(g[mine])).sum() + layer.aux["balance"] * (1.0 / n)).backward()
    assert layer.aux["tokens_per_expert"][0] == 6 and layer.aux["tokens_per_expert"].sum() == 6
    assert equivalence.rel_diff(xl.grad, xr.grad[mine])[0] <= 1e-12, "input gradient"
    assert equivalence.rel_diff(yl.data, yr.data[mine])[0] <= 1e-12, "output"
    if rank == 0:
        assert equivalence.rel_diff(layer.c_fc.weight.grad, ref.c_fc.weight.grad[:2])[0] <= 1e-12
    else:
        assert layer.c_fc.weight.grad is None, "an expert that got no rows gets no gradient"
    assert len(layer.comm_bytes) == 4
