"""The split backward zero-bubble schedules use: B now (input gradients), W later (weights).

    python -m pytest -q tests/test_split_backward.py

With `deferred_weight_grads()` active, a backward computes the gradient of the input
and of everything that is not a Parameter operand of a Linear or a MatMul; those wait
on the list as WeightGrads until `run_weight_grads` (W) adds them into .grad. Float64,
and the comparison is exact: W must add the very numbers the plain backward adds, in
the same order, a Parameter used twice (once deferred, once not) included. What W holds
(the saved input and the output gradient) counts as activation memory until it runs.
"""
import numpy as np
import pytest

from minidist import ops
from minidist.model import GPT, GPTConfig
from minidist.nn import Parameter
from minidist.tensor import MEMORY, Tensor, deferred_weight_grads, run_weight_grads

C, B, T = 6, 2, 3


def params(seed=0):
    g = np.random.default_rng(seed)
    return {"W1": Parameter(g.normal(size=(C, 2 * C))), "b1": Parameter(g.normal(size=2 * C)),
            "W2": Parameter(g.normal(size=(2 * C, C))), "M": Parameter(g.normal(size=(C, C))),
            "v": Parameter(g.normal(size=C)), "E": Parameter(g.normal(size=(C, C))),
            "lnw": Parameter(1 + g.normal(size=C)), "lnb": Parameter(g.normal(size=C))}


DEFERRED = ("W1", "b1", "W2", "M", "v", "E")     # a Linear's or a MatMul's operand (E: once)
IN_B = ("lnw", "lnb")                            # layer norm: computed during B


def stage(P, x, idx):
    """A pipeline stage's worth of ops: E is used twice, as an embedding (that gradient
    is computed in B) and as a linear's weight (deferred): W adds both parts, in order."""
    h = x + ops.embedding(idx, P["E"])                              # (B, T, C)
    h = ops.gelu(ops.linear(h, P["W1"], P["b1"]))                   # (B, T, 2C)
    h = ops.linear(h, P["W2"])                                      # (B, T, C)
    h = ops.layer_norm(h, P["lnw"], P["lnb"])
    h = ops.matmul(h, P["M"]) + ops.linear(h, P["E"])               # (B, T, C)
    return h * ops.matmul(h, P["v"]).reshape(B, T, 1)               # 1-D operand: (B, T)


def inputs(seed=1):
    g = np.random.default_rng(seed)
    return Tensor(g.normal(size=(B, T, C)), requires_grad=True), g.integers(0, C, (B, T)), g.normal(size=(B, T, C))


def plain(micro=1):
    P = params()
    xs = []
    for k in range(micro):
        x, idx, gout = inputs(1 + k)
        stage(P, x, idx).backward(gout)
        xs.append(x.grad)
    return P, xs


def test_b_computes_input_gradients_and_w_the_weights_exactly():
    ref, (ref_x,) = plain()
    P = params()
    x, idx, gout = inputs()
    base = MEMORY.live_bytes
    out = stage(P, x, idx)
    with deferred_weight_grads() as later:
        out.backward(gout)
    # after B: the input gradient, exactly; no deferred Parameter touched
    assert np.array_equal(x.grad, ref_x), "B's input gradient differs from the plain backward's"
    untouched = [k for k in DEFERRED if P[k].grad is not None]
    assert not untouched, f"B wrote .grad of {untouched}: their gradients belong to W"
    assert len(later) == 6, (f"one WeightGrad per Linear/MatMul node with a Parameter and one for E's "
                             f"embedding part, got {len(later)}")
    for k in IN_B:
        assert np.array_equal(P[k].grad, ref[k].grad), f"{k} (not split) differs after B"
    params_data = {id(p.data) for p in P.values()}
    held = sum(wg.grad.nbytes + sum(a.nbytes for a in (wg.ctx.saved if wg.ctx else ()) if id(a) not in params_data)
               for wg in later)
    assert MEMORY.live_bytes - base == held, (
        "W holds the saved inputs and the output gradients: their bytes count as activations until it runs")
    # W
    run_weight_grads(later)
    assert not later and MEMORY.live_bytes == base, "W must free what it held"
    for k in P:
        assert np.array_equal(P[k].grad, ref[k].grad), (
            f"{k}: after W the gradient differs from the plain backward's by "
            f"{np.abs(P[k].grad - ref[k].grad).max():.2e}")


@pytest.mark.parametrize("order", ["B0 W0 B1 W1", "B0 B1 W0 W1"])
def test_micro_batches_accumulate_as_the_plain_backward(order):
    """1F1B-like and ZB-H1-like orders of two micro-batches: the same .grad, exactly."""
    ref, ref_xs = plain(micro=2)
    P = params()
    outs, held = [], {}
    for k in range(2):
        x, idx, gout = inputs(1 + k)
        outs.append((x, stage(P, x, idx), gout))
    for a in order.split():
        k = int(a[1])
        if a[0] == "B":
            x, out, gout = outs[k]
            with deferred_weight_grads() as held[k]:
                out.backward(gout)
            assert np.array_equal(x.grad, ref_xs[k])
        else:
            run_weight_grads(held.pop(k))
    for k in P:
        assert np.array_equal(P[k].grad, ref[k].grad), f"{k} differs after {order}"


def test_hooks_fire_when_w_completes_the_gradient():
    P = params()
    x, idx, gout = inputs()
    fired = []
    for k in ("W2", "lnw"):
        P[k].register_grad_ready_hook(lambda t, k=k: fired.append((k, t.grad is not None)))
    out = stage(P, x, idx)
    with deferred_weight_grads() as later:
        out.backward(gout)
    assert fired == [("lnw", True)], f"during B only layer norm's hook may fire, got {fired}"
    run_weight_grads(later)
    assert fired == [("lnw", True), ("W2", True)]


def test_gpt_split_backward_equals_plain():
    """The GPT (tied wte: embedding and head, both in B; every Linear split): exact."""
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0, dtype="float64")
    x = np.random.default_rng(3).integers(0, 32, (2, 8))
    y = np.roll(x, -1, axis=1)
    ref = GPT(cfg, seed=5)
    ref(x, y)[1].backward()
    model = GPT(cfg, seed=5)
    loss = model(x, y)[1]
    with deferred_weight_grads() as later:
        loss.backward()
    split = {n for n, p in model.named_parameters() if p.grad is None}
    assert any(n.endswith("c_fc.weight") for n in split) and "transformer.wte.weight" not in split
    run_weight_grads(later)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert np.array_equal(p.grad, q.grad), f"{name}: split backward differs from the plain one"


def test_without_the_context_nothing_is_deferred():
    P = params()
    x, idx, gout = inputs()
    stage(P, x, idx).backward(gout)
    assert all(P[k].grad is not None for k in P)


def test_a_parameter_used_twice_fires_its_hook_once_with_its_whole_gradient():
    """E is used twice (embedding: computed in B, held; linear: deferred), and so is W2 in
    `twice` below (two Linears): W completes each only after its last piece, so the hook
    must fire once per backward, after W, seeing exactly the plain backward's gradient.
    A hook that fired after the first piece would hand data parallelism (its all-reduce
    starts from this hook) a partial gradient."""
    def twice(P, x, idx):
        h = stage(P, x, idx)
        return ops.linear(ops.linear(h, P["W1"]), P["W2"]) + h

    ref = params()
    x, idx, gout = inputs()
    twice(ref, x, idx).backward(gout)
    P = params()
    x, idx, gout = inputs()
    seen = {k: [] for k in P}
    for k in P:
        P[k].register_grad_ready_hook(lambda t, k=k: seen[k].append(t.grad.copy()))
    out = twice(P, x, idx)
    with deferred_weight_grads() as later:
        out.backward(gout)
    assert not any(seen[k] for k in DEFERRED), "a deferred Parameter's hook fired during B"
    run_weight_grads(later)
    for k in P:
        assert len(seen[k]) == 1, f"{k}'s hook fired {len(seen[k])} times in one backward, not once"
        assert np.array_equal(seen[k][0], ref[k].grad), (
            f"{k}'s hook saw a gradient that is not the whole one (max diff "
            f"{np.abs(seen[k][0] - ref[k].grad).max():.2e}): it fired before its last piece")
