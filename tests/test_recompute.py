"""Activation recomputation (minidist/recompute.py) changes memory, never the numbers.

Each policy trains the GPT (float64, dropout on, AdamW with clipping) and must give the
losses, the raw gradients of every step and the weights of the run without it, to 1e-12
per tensor (they are in fact bit for bit equal: the rerun is the same arithmetic). The
meter's peak over the blocks' forward and backward equals this engine's count for the
policy (plan.memory.recompute_peak_elements), and on a sweep of L it grows as L without
recomputation, as sqrt(L) with a checkpoint every sqrt(L) blocks. Planted bugs (masks
not replayed, activations saved anyway) are caught.
"""
import argparse
import math
import types

import numpy as np
import pytest

import minidist
from minidist import recompute
from minidist import equivalence
from minidist.model import GPT, GPTConfig
from minidist.plan.memory import recompute_peak_elements
from minidist.rng import DropoutRNG
from minidist.tensor import MEMORY, Tensor, no_grad
from minidist.train import TrainConfig

TOL = 1e-12


def _cfg(L=3, dropout=0.1):
    return GPTConfig(block_size=8, vocab_size=256, n_layer=L, n_head=2, n_embd=16, dropout=dropout, dtype="float64")


def _train(policy, k=None, cfg=None, steps=2):
    from minidist.data import Dataset
    cfg = cfg or _cfg()
    args = argparse.Namespace(steps=steps, batch_size=4, seed=3)
    data = Dataset.from_text("hello recomputation " * 50, cfg.block_size, seed=3)
    model = GPT(cfg, seed=3).set_recompute(policy, k)
    tc = TrainConfig(batch_size=4, max_iters=steps, learning_rate=1e-2, warmup_iters=1, grad_clip=0.05, seed=3)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate)
    losses, state, _ = equivalence.train_and_collect(model, opt, data, args, tc, micro=2)
    state["loss"] = np.array(losses)
    return state


@pytest.fixture(scope="module")
def reference():
    return _train("none")


@pytest.mark.parametrize("policy,k", [("full", None), ("every-k", None), ("every-k", 2), ("every-k", 5),
                                      ("selective", None)])
def test_training_equals_no_recomputation(reference, policy, k):
    state = _train(policy, k)
    rel, _, worst = equivalence.compare(state, reference)
    assert rel <= TOL, f"{policy}: max_rel_diff {rel:.2e} in {worst}"
    assert any(k.startswith("grad:") for k in state) and len(state) == len(reference)


def _masks_not_replayed(fn, inputs, counters, grad):
    """The planted bug: the rerun draws the masks that come after the forward's (the
    counters are put back afterwards, so only the masks are wrong)."""
    now = [(rng, rng.calls) for rng, _ in counters]
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]


def test_masks_not_replayed_fail_the_comparison(reference, monkeypatch):
    monkeypatch.setattr(recompute, "checkpoint_backward", _masks_not_replayed)
    rel, _, worst = equivalence.compare(_train("full"), reference)
    assert rel > 1e-3, f"not replaying the dropout masks went unnoticed ({rel:.1e})"
    assert worst.startswith("grad:") or worst.startswith("weight:")


def _body_peak(model, b=2, seed=0):
    """The meter's peak over the blocks' forward and a backward from a non-scalar output."""
    cfg = model.config
    g = np.random.default_rng(seed)
    leaf = Tensor(g.standard_normal((b, cfg.block_size, cfg.n_embd)), requires_grad=True)
    rng = DropoutRNG(seed, 0, range(b)) if cfg.dropout > 0 else None
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    x = leaf.reshape(leaf.shape)                       # not a leaf: as the embedding's output
    y = recompute.run_blocks(model.recompute, model.transformer.h, x, rng)
    y.backward(g.standard_normal(y.shape))
    assert MEMORY.live_bytes == base, "the backward left saved arrays behind"
    return MEMORY.peak_bytes - base, leaf.grad


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", recompute.POLICIES)
def test_peak_equals_the_count_and_the_input_gradient_is_unchanged(policy, dropout):
    cfg = _cfg(L=5, dropout=dropout)
    peak, grad = _body_peak(GPT(cfg, seed=1).set_recompute(policy))
    _, want_grad = _body_peak(GPT(cfg, seed=1))
    b, s, h, a = 2, cfg.block_size, cfg.n_embd, cfg.n_head
    count = recompute_peak_elements(policy, 5, b, s, h, a, dropout=dropout > 0, k=recompute.default_k(5)) * 8
    assert peak == count, f"{policy}: the meter read {peak} bytes, this engine's count is {count}"
    assert equivalence.rel_diff(grad, want_grad)[0] <= TOL


def test_switching_policies_on_one_model_equals_a_fresh_model():
    """set_recompute on a live model, from every policy to every other (and back): the
    meter's peak and the input's gradient are those of a fresh model built with the last
    policy; a policy switched off leaves nothing checkpointed behind."""
    cfg = _cfg(L=2, dropout=0.1)
    fresh = {pol: _body_peak(GPT(cfg, seed=1).set_recompute(pol)) for pol in recompute.POLICIES}
    for first in recompute.POLICIES:
        for then in recompute.POLICIES:
            model = GPT(cfg, seed=1).set_recompute(first)
            _body_peak(model)                             # run once under the first policy
            for pol in (then, first):
                peak, grad = _body_peak(model.set_recompute(pol))
                assert peak == fresh[pol][0], (f"{first} -> {then}" + (f" -> {first}" if pol is first else "")
                                               + f": peak {peak:,} B, a fresh model with {pol} peaks at "
                                               f"{fresh[pol][0]:,} B")
                assert equivalence.rel_diff(grad, fresh[pol][1])[0] <= TOL
                cores = [blk.attn.recompute_core for blk in model.transformer.h]
                assert cores == [pol == "selective"] * cfg.n_layer, f"{first} -> {pol}: attention cores {cores}"


def test_full_keeps_only_block_inputs_plus_one_rebuild():
    cfg = _cfg(L=4, dropout=0.1)
    none, _ = _body_peak(GPT(cfg, seed=1))
    full, _ = _body_peak(GPT(cfg, seed=1).set_recompute("full"))
    x = 2 * cfg.block_size * cfg.n_embd * 8           # one block input, b = 2
    assert full == 4 * x + none // 4                  # L inputs + one block's saves


def test_sweep_grows_as_L_without_and_as_sqrt_L_with_every_sqrt_L():
    rows = []
    for L in (4, 9, 16):
        none, _ = _body_peak(GPT(_cfg(L, 0.0), seed=1))
        every, _ = _body_peak(GPT(_cfg(L, 0.0), seed=1).set_recompute("every-k"))
        rows.append((L, none, every))
    per_layer = [n / L for L, n, _ in rows]
    assert max(per_layer) == min(per_layer), per_layer          # exactly L times one layer
    per_sqrt = [e / math.sqrt(L) for L, _, e in rows]           # k = sqrt(L): sqrt(L) inputs + sqrt(L) blocks
    assert max(per_sqrt) == min(per_sqrt), per_sqrt
    assert rows[-1][2] < rows[-1][1] / 3


def _forward_keeps(forward):
    """Bytes the meter holds while checkpoint_forward's output (one block's) is alive."""
    cfg = _cfg(L=1, dropout=0.1)
    block = GPT(cfg, seed=1).transformer.h[0]
    x = Tensor(np.ones((2, cfg.block_size, cfg.n_embd)), requires_grad=True).reshape(2, cfg.block_size, cfg.n_embd)
    base = MEMORY.live_bytes
    out, _ = forward(block, [x, DropoutRNG(0, 0, range(2))])
    kept = MEMORY.live_bytes - base
    del out
    return kept


def test_saving_activations_anyway_is_caught():
    """The planted bug: a forward that records fn's graph keeps every activation."""
    def keeps_the_graph(fn, inputs):
        return fn(*inputs), recompute.dropout_counters(inputs)
    assert _forward_keeps(recompute.checkpoint_forward) == 0
    assert _forward_keeps(keeps_the_graph) > 0


def test_checkpoint_of_a_function_with_parameters_and_no_grad_input():
    """Parameters used inside fn get their gradients even when no input needs one."""
    w = Tensor(np.random.default_rng(0).standard_normal((4, 3)), requires_grad=True)
    x = Tensor(np.random.default_rng(1).standard_normal((2, 4)))

    def fn(x):
        return (x @ w) * (x @ w)
    fn(x).sum().backward()
    want, w.grad = w.grad, None
    y = recompute.checkpoint(fn, x)
    assert MEMORY.live_bytes >= 0 and y.requires_grad
    y.sum().backward()
    assert np.array_equal(w.grad, want)
    with no_grad():
        assert not recompute.checkpoint(fn, x).requires_grad


def test_the_checkpoint_package_is_a_plain_module_and_recompute_keeps_its_name():
    """Two names for the two meanings of "checkpoint": the saved run is the package
    minidist.checkpoint, an ordinary module (no class swapped to make it callable);
    activation checkpointing is minidist.recompute.checkpoint."""
    import minidist.checkpoint as package
    assert type(package) is types.ModuleType and not callable(package)
    assert minidist.checkpoint is package and callable(recompute.checkpoint)


def test_a_rerun_that_moves_the_counter_is_refused(monkeypatch):
    def forgets_to_restore(fn, inputs, counters, grad):
        for rng, start in counters:
            rng.calls = start
        leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
        fn(*leaves).backward(grad)
        return [x.grad if isinstance(x, Tensor) else None for x in leaves]
    monkeypatch.setattr(recompute, "checkpoint_backward", forgets_to_restore)
    with pytest.raises(RuntimeError, match="counter moved"):
        _train("full", steps=1)


def test_the_counter_is_where_it_was_after_the_rerun():
    cfg = _cfg(L=2, dropout=0.2)
    model = GPT(cfg, seed=1).set_recompute("full")
    rng = DropoutRNG(0, 0, range(2))
    x = Tensor(np.ones((2, cfg.block_size, cfg.n_embd)), requires_grad=True).reshape(2, cfg.block_size, cfg.n_embd)
    y = recompute.run_blocks(model.recompute, model.transformer.h, x, rng)
    calls = rng.calls
    assert calls == 2 * 3                               # 3 dropout calls per block
    y.sum().backward()
    assert rng.calls == calls


@pytest.mark.parametrize("bad", [("sometimes", None), ("every-k", 0), ("every-k", 1.5)])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        GPT(_cfg(), seed=1).set_recompute(*bad)


def test_generation_with_a_cache_ignores_the_policy():
    from minidist.model import generate_greedy
    cfg = _cfg(L=2, dropout=0.0)
    idx = np.zeros((1, 3), dtype=np.int64)
    a, _ = generate_greedy(GPT(cfg, seed=1), idx, 4)
    b, _ = generate_greedy(GPT(cfg, seed=1).set_recompute("full"), idx, 4)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("policy, k", [("full", None), ("every-k", 2), ("selective", None)])
def test_a_pipeline_stage_recomputes_from_the_next_stages_gradient(policy, k):
    """What 3D parallelism needs: each stage of a pipeline (PipelineGPT, 5 layers over 2
    stages, dropout on) runs its blocks under the policy, and the backward starts from a
    non-scalar gradient (the one the next stage sends) on the first stage, from the loss
    on the last. Every parameter's and the input's gradient equal the stage's without
    recomputation; the meter's peak over the stage shows the policy was applied."""
    from minidist.parallel.pipeline_parallel import PipelineGPT, dropout_calls_before
    cfg = _cfg(L=5)
    g = np.random.default_rng(7)
    idx = g.integers(0, cfg.vocab_size, (2, cfg.block_size))
    targets = g.integers(0, cfg.vocab_size, (2, cfg.block_size))
    grad_out = g.standard_normal((2, cfg.block_size, cfg.n_embd))
    x_mid = g.standard_normal((2, cfg.block_size, cfg.n_embd))

    def run(name, rank):
        stage = PipelineGPT(GPT(cfg, seed=3), 2, rank).set_recompute(name, k)
        rng = DropoutRNG(3, 0, range(2))
        rng.calls = 0 if rank == 0 else dropout_calls_before(stage.ranges[1][0])
        x = None if rank == 0 else Tensor(x_mid, requires_grad=True)
        MEMORY.reset_peak()
        base = MEMORY.live_bytes
        out = stage.forward_chunk(0, idx if rank == 0 else x, targets, rng)
        out.backward(grad_out) if rank == 0 else out.backward()
        grads = {n: p.grad.copy() for n, p in stage.named_parameters()}
        if x is not None:
            grads["input"] = x.grad.copy()
        return grads, MEMORY.peak_bytes - base, stage

    for rank in (0, 1):
        want, peak_none, _ = run("none", rank)
        got, peak, stage = run(policy, rank)
        assert stage.recompute.name == policy and len(stage.blocks()) == (3 if rank == 0 else 2)
        rel, _, worst = equivalence.compare(got, want)
        assert rel <= TOL, f"{policy}, stage {rank}: max_rel_diff {rel:.2e} at {worst}"
        assert peak < peak_none, f"{policy}, stage {rank}: peak {peak} not below none's {peak_none}"
