"""Mixture of experts (minidist/moe.py): routing rules on hand-made gates, capacity per
group, dropped tokens, the combine weights, the two auxiliary losses, gradients against
central differences, and the GPT with and without experts."""
import numpy as np
import pytest

from minidist import moe
from minidist.model import GPT, MLP, GPTConfig
from minidist.moe import MoEMLP, balance_loss, combine_weights, expert_capacity, route, z_loss
from minidist.tensor import Tensor, no_grad

TINY = dict(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=11, dtype="float64")

# ----------------------------------------------------------------------------- routing rules


@pytest.mark.parametrize("tokens, k, E, cf, want", [
    (8, 2, 4, 1.25, 5),          # 8 * 2 / 4 * 1.25 = 5 exactly
    (10, 1, 4, 1.0, 3),          # 2.5 -> 3: ceil, not round
    (12, 1, 4, 1.0, 3),          # 3 exactly stays 3
    (50, 1, 11, 1.1, 5),         # 5.000000000000001 in floats: still 5
    (4, 1, 8, 1.0, 1),           # 0.5 -> 1
    (8, 2, 4, None, None),       # dropless
])
def test_capacity_is_the_ceiling_of_the_formula(tokens, k, E, cf, want):
    assert expert_capacity(tokens, k, E, cf) == want


def test_top_k_orders_by_probability_and_breaks_ties_by_expert_index():
    probs = np.array([[0.25, 0.25, 0.25, 0.25],
                      [0.1, 0.4, 0.4, 0.1],
                      [0.1, 0.2, 0.3, 0.4],
                      [0.5, 0.1, 0.3, 0.1]])
    experts, keep = route(probs, 2, None)
    assert experts.dtype == np.int64 and keep.dtype == bool
    assert experts.tolist() == [[0, 1], [1, 2], [3, 2], [0, 2]]
    assert keep.all(), "dropless (capacity None) keeps every choice"
    assert route(probs, 1, None)[0].tolist() == [[0], [1], [3], [0]]


def naive_route(probs, top_k, capacity):
    """The rules written as plain Python sorts, for the comparison below."""
    T, E = probs.shape
    experts = [sorted(range(E), key=lambda e: (-probs[t, e], e))[:top_k] for t in range(T)]
    keep = [[True] * top_k for _ in range(T)]
    for e in range(E):
        choices = sorted(((t, j) for t in range(T) for j in range(top_k) if experts[t][j] == e),
                         key=lambda tj: (-probs[tj[0], e], tj[0]))
        for t, j in choices[capacity:] if capacity is not None else []:
            keep[t][j] = False
    return experts, keep


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("E", [4, 64])
def test_route_follows_the_rules_on_inputs_full_of_ties(top_k, E):
    # few distinct values: many ties, at sizes where an unstable sort reorders them
    g = np.random.default_rng(E + top_k)
    probs = g.integers(1, 4, size=(200, E)).astype(np.float64)
    probs /= probs.sum(axis=1, keepdims=True)
    for capacity in (None, 3, expert_capacity(200, top_k, E, 1.0)):
        experts, keep = route(probs, top_k, capacity)
        want_experts, want_keep = naive_route(probs, top_k, capacity)
        assert experts.tolist() == want_experts
        assert keep.tolist() == want_keep, f"capacity {capacity}"


def test_capacity_keeps_the_highest_probabilities_ties_by_token_index():
    # every token's first choice is expert 0; capacity 2 keeps tokens 1 (0.9) and 3 (0.7)
    probs = np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.5, 0.25, 0.25], [0.7, 0.2, 0.1]])
    _, keep = route(probs, 1, 2)
    assert keep[:, 0].tolist() == [False, True, False, True]
    # a three-way tie at 0.6: the two lowest token indices stay
    probs = np.array([[0.6, 0.4], [0.6, 0.4], [0.6, 0.4], [0.1, 0.9]])
    experts, keep = route(probs, 1, 2)
    assert experts[:, 0].tolist() == [0, 0, 0, 1]
    assert keep[:, 0].tolist() == [True, True, False, True]


def test_capacity_counts_all_k_choices_by_probability_not_by_slot():
    # expert 1 is token 0's second choice (0.35) and token 1's first (0.5), token 2's
    # second (0.3); capacity 2 keeps 0.5 and 0.35 and drops token 2's second choice
    probs = np.array([[0.45, 0.35, 0.2], [0.2, 0.5, 0.3], [0.6, 0.3, 0.1]])
    experts, keep = route(probs, 2, 2)
    assert experts.tolist() == [[0, 1], [1, 2], [0, 1]]
    assert keep.tolist() == [[True, True], [True, True], [True, False]]
    assert route(probs, 2, None)[1].all()


def test_position_fills_every_first_choice_before_any_second_choice():
    # GShard's order: expert 1 is token 0's second choice and tokens 1, 2's first; capacity
    # 2 keeps the two first choices and drops token 0's second, though it comes first
    probs = np.array([[0.45, 0.35, 0.2], [0.2, 0.5, 0.3], [0.1, 0.6, 0.3]])
    experts, keep = moe.route_by_position(probs, 2, 2)
    assert experts.tolist() == [[0, 1], [1, 2], [1, 2]]
    assert keep.tolist() == [[True, False], [True, True], [True, True]]
    # top-1: Switch's cumulative order, the first `capacity` tokens, whatever their probability
    probs = np.array([[0.5, 0.5], [0.9, 0.1], [0.7, 0.3], [0.1, 0.9]])
    assert moe.route_by_position(probs, 1, 2)[1][:, 0].tolist() == [True, True, False, True]
    assert moe.route(probs, 1, 2)[1][:, 0].tolist() == [False, True, True, True]
    assert moe.route_by_position(probs, 1, None)[1].all()


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_later_token_decides_an_earlier_drop_under_probs_only(top_k):
    """Raise the last token's probability for token 0's expert: under probs it pushes token
    0's first choice out (a later token decided an earlier one's fate: not causal in a
    decoder); under position token 0 keeps its place."""
    probs = np.array([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1], [0.2, 0.1, 0.7]])
    later = probs.copy()
    later[2] = [0.8, 0.15, 0.05]
    for policy, dropped_after in [("probs", True), ("position", False)]:
        before = moe.select(probs, top_k, 2, policy)[1]
        after = moe.select(later, top_k, 2, policy)[1]
        assert before[0, 0] and after[0, 0] != dropped_after, policy
    with pytest.raises(ValueError, match="drop policy must be one of"):
        moe.select(probs, 1, 2, "random")


def test_the_router_multiplies_in_fp32_under_mixed_precision():
    from minidist.precision import autocast      # fp16: NumPy's own, no ml_dtypes to import
    g = np.random.default_rng(3)
    x = Tensor(g.normal(size=(16, 32)).astype(np.float32))
    w = Tensor(g.normal(size=(32, 8)).astype(np.float16).astype(np.float32), requires_grad=True)
    with autocast("fp16"):
        probs, logits = moe.gates(x, w)
        rounded = (x @ w).data                      # a plain MatMul: 16-bit inputs and output
    np.testing.assert_array_equal(logits.data, x.data @ w.data)
    assert np.abs(rounded - logits.data).max() > 1e-4            # so the test can fail
    assert logits.data.dtype == np.float32

# ----------------------------------------------------------------------------- the layer


def make_layer(E=2, k=1, cf=1.0, C=2, alpha=0.01, z=0.0, dropout=0.0, seed=0):
    cfg = GPTConfig(n_embd=C, n_head=1, n_expert=E, top_k=k, capacity_factor=cf, moe_alpha=alpha, moe_z=z,
                    dropout=dropout, dtype="float64")
    layer = MoEMLP(cfg)
    g = np.random.default_rng(seed)
    for p in layer.parameters():
        p.data = g.normal(0.0, 0.5, size=p.shape)
    return layer


def hand_layer():
    """Two experts, top-1, capacity factor 1; router = identity, so the logits are x itself."""
    layer = make_layer(E=2, k=1, cf=1.0)
    layer.router.weight.data = np.eye(2)
    return layer


# four tokens, all preferring expert 0, most strongly token (0,0), then (0,1), (1,1), (1,0)
X_HAND = np.array([[[3.0, 0.0], [2.0, 0.0]],
                   [[1.0, 0.0], [1.5, 0.0]]])


@pytest.mark.parametrize("policy, two_groups", [
    ("probs", [[False, True], [True, False]]),        # each row keeps its own strongest token
    ("position", [[False, True], [False, True]]),     # each row keeps its own first token
])
def test_one_group_and_two_groups_route_differently_when_capacity_binds(policy, two_groups):
    layer = hand_layer()
    layer.drop_policy = policy
    with no_grad():
        y1 = layer(Tensor(X_HAND), n_groups=1).data
        assert layer.aux["dropped"] == 2 and layer.aux["tokens_per_expert"].tolist() == [2, 0]
        y2 = layer(Tensor(X_HAND), n_groups=2).data
        assert layer.aux["dropped"] == 2 and layer.aux["tokens_per_expert"].tolist() == [2, 0]
    zero1 = (y1 == 0).all(axis=-1)          # which tokens got nothing: dropped, residual only
    zero2 = (y2 == 0).all(axis=-1)
    # one group of 4, capacity 2: expert 0 keeps the two strongest, also the first two, row 0
    assert zero1.tolist() == [[False, False], [True, True]]
    # two groups of 2, capacity 1 each
    assert zero2.tolist() == two_groups


def test_dropless_drops_nothing_and_groups_then_change_nothing():
    layer = hand_layer()
    layer.capacity_factor = None
    with no_grad():
        y1 = layer(Tensor(X_HAND), n_groups=1).data
        assert layer.aux["dropped"] == 0 and layer.aux["tokens_per_expert"].tolist() == [4, 0]
        y2 = layer(Tensor(X_HAND), n_groups=2).data
    assert not (y1 == 0).all(axis=-1).any()
    np.testing.assert_array_equal(y1, y2)


def test_a_kept_token_gets_its_gate_times_its_expert():
    layer = hand_layer()
    with no_grad():
        y = layer(Tensor(X_HAND)).data
        x = Tensor(X_HAND[0, 0][None, :])
        p0 = np.exp(3.0) / (np.exp(3.0) + 1.0)
        want = p0 * layer.expert(x, 0).data[0]
    np.testing.assert_allclose(y[0, 0], want, rtol=1e-12)


def test_n_groups_must_divide_the_batch():
    with pytest.raises(ValueError, match="not divisible by n_groups=3"):
        hand_layer()(Tensor(X_HAND), n_groups=3)


def test_top2_weights_are_renormalised_before_dropping():
    probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    experts = np.array([[0, 1], [1, 2]])
    keep = np.array([[True, True], [True, False]])
    w = combine_weights(Tensor(probs), experts, keep, 2).data
    np.testing.assert_allclose(w, [[0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.9, 0.0]], rtol=1e-12)
    w1 = combine_weights(Tensor(probs), experts[:, :1], keep[:, :1], 1).data
    np.testing.assert_allclose(w1, [[0.5], [0.6]], rtol=1e-12)     # top-1: the gate itself (Switch)

# ----------------------------------------------------------------------------- auxiliary losses


def test_balance_loss_is_alpha_when_routing_is_uniform():
    E = 4
    probs = Tensor(np.full((8, E), 1.0 / E))
    experts = np.array([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3], [2, 0], [3, 1]])
    assert balance_loss(probs, experts, E, 2, alpha=0.01).item() == pytest.approx(0.01, rel=1e-12)


def test_balance_loss_on_a_skewed_hand_example():
    # all four tokens chose expert 0 (f = [1, 0, 0, 0]); P_0 = mean(0.7, 0.7, 0.4, 0.6) = 0.6
    probs = Tensor(np.array([[0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1], [0.6, 0.1, 0.2, 0.1]]))
    experts = np.zeros((4, 1), dtype=np.int64)
    assert balance_loss(probs, experts, 4, 1, alpha=0.5).item() == pytest.approx(0.5 * 4 * 0.6, rel=1e-12)


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]])
    lse = np.log(np.exp(logits).sum(axis=1))
    assert z_loss(Tensor(logits), coef=0.1).item() == pytest.approx(0.1 * np.mean(lse ** 2), rel=1e-12)


def test_layer_aux_loss_is_the_mean_over_groups():
    layer = make_layer(E=4, k=2, cf=1.0, C=4, alpha=0.01, z=0.001)
    x = np.random.default_rng(1).normal(size=(4, 3, 4))
    with no_grad():
        layer(Tensor(x), n_groups=2)
        got_b, got_z = layer.aux["balance"].item(), layer.aux["z"].item()
        want_b, want_z = 0.0, 0.0
        for g in range(2):
            xg = Tensor(x[2 * g:2 * g + 2].reshape(6, 4))
            probs, logits = moe.gates(xg, layer.router.weight)
            experts, _ = route(probs.data, 2, None)
            want_b += balance_loss(probs, experts, 4, 2, 0.01).item() / 2
            want_z += z_loss(logits, 0.001).item() / 2
    assert got_b == pytest.approx(want_b, rel=1e-12) and got_z == pytest.approx(want_z, rel=1e-12)

# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("k, cf, groups", [(1, 0.5, 1), (2, 0.5, 2), (2, None, 1)])
def test_gradients_match_central_differences(k, cf, groups):
    """Router, experts and input against central differences, in float64, with the
    balance loss and the z-loss on. The selection is a constant: the check asserts it
    does not move under the perturbations (inputs drawn away from ties)."""
    layer = make_layer(E=3, k=k, cf=cf, C=4, alpha=0.3, z=0.2, seed=2)
    x = Tensor(np.random.default_rng(3).normal(size=(2, 5, 4)), requires_grad=True)
    r = np.random.default_rng(4).normal(size=(2, 5, 4))

    def loss():
        y = layer(x, n_groups=groups)
        return (y * Tensor(r)).sum() + layer.aux["balance"] + layer.aux["z"]

    loss().backward()
    routing = (layer.aux["tokens_per_expert"].tolist(), layer.aux["dropped"])
    if cf is not None:
        assert routing[1] > 0, "the check should cover dropped tokens"
    pick, eps = np.random.default_rng(0), 1e-6
    for name, p in [*layer.named_parameters(), ("x", x)]:
        for _ in range(6):
            i = tuple(int(pick.integers(0, n)) for n in p.shape)
            old = p.data[i]
            with no_grad():
                p.data[i] = old + eps
                up = loss().item()
                assert (layer.aux["tokens_per_expert"].tolist(), layer.aux["dropped"]) == routing
                p.data[i] = old - eps
                down = loss().item()
            p.data[i] = old
            numeric = (up - down) / (2 * eps)
            assert np.isclose(p.grad[i], numeric, rtol=1e-5, atol=1e-8), \
                f"{name}{list(i)}: gradient {p.grad[i]:.8g}, central difference {numeric:.8g}"


def test_the_selection_gets_no_gradient_but_the_router_does():
    layer = make_layer(E=3, k=2, cf=1.0, C=4, alpha=0.0, z=0.0)
    y = layer(Tensor(np.random.default_rng(5).normal(size=(2, 3, 4))))
    y.sum().backward()
    assert np.abs(layer.router.weight.grad).sum() > 0, "the router learns through the gate weights"

# ----------------------------------------------------------------------------- the GPT


def test_which_blocks_are_moe():
    cfg = GPTConfig(**{**TINY, "n_layer": 4}, n_expert=4)
    model = GPT(cfg)
    assert [i for i, _ in model.moe_layers()] == [1, 3]              # every other layer
    assert [i for i, _ in GPT(GPTConfig(**{**TINY, "n_layer": 3}, n_expert=4, moe_every=1)).moe_layers()] == [0, 1, 2]
    names = dict(model.named_parameters())
    C, E = TINY["n_embd"], 4
    assert names["transformer.h.1.mlp.router.weight"].shape == (C, E)
    assert names["transformer.h.1.mlp.c_fc.weight"].shape == (E, C, 4 * C)
    assert names["transformer.h.1.mlp.c_fc.bias"].shape == (E, 4 * C)
    assert names["transformer.h.1.mlp.c_proj.weight"].shape == (E, 4 * C, C)
    assert names["transformer.h.1.mlp.c_proj.bias"].shape == (E, C)
    assert "transformer.h.0.mlp.c_fc.weight" in names and names["transformer.h.0.mlp.c_fc.weight"].ndim == 2
    std = names["transformer.h.1.mlp.c_fc.weight"].data.std()
    assert 0.015 < std < 0.025, f"experts drawn like the dense MLP, N(0, 0.02): std {std}"
    again = dict(GPT(cfg).named_parameters())
    assert all(np.array_equal(p.data, again[n].data) for n, p in names.items()), "one random seed fixes every bit"


def test_n_expert_zero_is_the_dense_model_bit_for_bit():
    dense = GPT(GPTConfig(**TINY), seed=3)
    other = GPT(GPTConfig(**TINY, n_expert=0, top_k=1, capacity_factor=None, moe_every=1, moe_groups=2,
                          moe_alpha=0.5, moe_z=0.5), seed=3)
    assert all(isinstance(b.mlp, MLP) for b in other.transformer.h) and other.moe_layers() == []
    assert [n for n, _ in dense.named_parameters()] == [n for n, _ in other.named_parameters()]
    assert dense.get_num_params() == other.get_num_params()
    x = np.random.default_rng(0).integers(0, 11, (2, 6))
    (la, a), (lb, b) = dense(x, x), other(x, x)
    assert np.array_equal(la.data, lb.data) and a.item() == b.item()
    assert other.moe_stats() == {}


def test_the_loss_includes_the_aux_losses():
    model = GPT(GPTConfig(**TINY, n_expert=4, moe_every=1, moe_z=0.01), seed=1)
    x = np.random.default_rng(0).integers(0, 11, (2, 6))
    logits, loss = model(x, x)
    from minidist import ops
    ce = ops.cross_entropy(logits, x).item()
    stats = model.moe_stats()
    assert sorted(stats) == [0, 1]
    aux = sum(s["balance"] + s["z"] for s in stats.values())
    assert all(s["balance"] > 0 and s["z"] > 0 for s in stats.values())
    assert loss.item() == pytest.approx(ce + aux, rel=1e-12)
    for s in stats.values():
        assert s["routed_per_expert"].sum() == 2 * 6 * 2 and s["dropped"] == (s["routed_per_expert"]
                                                                            - s["tokens_per_expert"]).sum()


def test_gpt_with_experts_matches_central_differences():
    model = GPT(GPTConfig(**TINY, n_expert=3, top_k=2, capacity_factor=None, moe_every=1, moe_alpha=0.1,
                          moe_z=0.1), seed=1)
    x = np.random.default_rng(0).integers(0, 11, (2, 6))
    _, loss = model(x, x)
    loss.backward()
    pick, eps = np.random.default_rng(0), 1e-6
    for name, p in model.named_parameters():
        if ".mlp." not in name:
            continue
        for _ in range(2):
            i = tuple(int(pick.integers(0, n)) for n in p.shape)
            old = p.data[i]
            with no_grad():
                p.data[i] = old + eps
                up = model(x, x)[1].item()
                p.data[i] = old - eps
                down = model(x, x)[1].item()
            p.data[i] = old
            numeric = (up - down) / (2 * eps)
            assert np.isclose(p.grad[i], numeric, rtol=1e-5, atol=1e-9), \
                f"{name}{list(i)}: gradient {p.grad[i]:.8g}, central difference {numeric:.8g}"


@pytest.mark.parametrize("top_k", [1, 2])
def test_gpt_with_experts_trains(top_k):
    model = GPT(GPTConfig(**{**TINY, "dtype": "float32"}, n_expert=4, top_k=top_k, moe_groups=2, moe_z=0.001), seed=0)
    opt = model.configure_optimizers(weight_decay=0.0, lr=1e-2)
    x = np.random.default_rng(0).integers(0, 11, (4, 8))
    losses = []
    for _ in range(15):
        _, loss = model(x, np.roll(x, -1, axis=1))
        model.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, f"loss should fall over 15 AdamW steps: {losses[0]:.3f} -> {losses[-1]:.3f}"
    assert all(p.grad is not None for _, p in model.named_parameters() if "router" in _)


@pytest.mark.parametrize("bad, match", [
    (dict(n_expert=-1), "n_expert"), (dict(n_expert=4, top_k=3), "top_k"), (dict(n_expert=1, top_k=2), "top_k"),
    (dict(n_expert=4, capacity_factor=0.0), "capacity_factor"), (dict(n_expert=4, moe_every=0), "moe_every"),
    (dict(n_expert=4, moe_groups=0), "moe_groups"), (dict(n_expert=4, moe_alpha=-1.0), "moe_alpha"),
])
def test_bad_moe_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**TINY, **bad).validate()


def test_whole_block_recomputation_is_refused_with_experts():
    model = GPT(GPTConfig(**TINY, n_expert=2))
    with pytest.raises(ValueError, match="auxiliary losses"):
        model.set_recompute("full")
    model.set_recompute("selective")


def test_dropout_masks_the_combined_output_with_the_dense_mlps_call():
    """One mask on the (B, T, C) output, as the dense MLP draws it: it follows the sample,
    so expert parallelism can draw the same one wherever the expert runs."""
    from minidist.rng import DropoutRNG
    layer = make_layer(E=3, k=2, cf=1.0, C=4, dropout=0.5)
    x = Tensor(np.random.default_rng(6).normal(size=(2, 3, 4)))
    with no_grad():
        dropped = layer(x, rng=DropoutRNG(1, 2, [0, 1])).data
        layer.eval()
        plain = layer(x).data
    mask = DropoutRNG(1, 2, [0, 1]).mask((2, 3, 4), 0.5, np.float64)
    np.testing.assert_array_equal(dropped, plain * mask)
