"""The GPT: gradients against central differences, seeds, names, per-sample dropout."""
import numpy as np
import pytest

from minidist.model import GPT, GPTConfig
from minidist.rng import DropoutRNG
from minidist.tensor import no_grad

TINY = dict(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=11, dtype="float64")


def batch(B=2, T=6, V=11, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradients_match_central_differences(dropout):
    model = GPT(GPTConfig(**TINY, dropout=dropout), seed=1)
    x, y = batch()
    make_rng = lambda: DropoutRNG(7, 3, range(len(x)))      # noqa: E731  same masks every call
    _, loss = model(x, y, rng=make_rng())
    loss.backward()
    pick = np.random.default_rng(0)
    eps = 1e-6
    for name, p in model.named_parameters():
        for _ in range(3):
            i = tuple(int(pick.integers(0, n)) for n in p.shape)
            old = p.data[i]
            with no_grad():
                p.data[i] = old + eps
                up = model(x, y, rng=make_rng())[1].item()
                p.data[i] = old - eps
                down = model(x, y, rng=make_rng())[1].item()
            p.data[i] = old
            numeric = (up - down) / (2 * eps)
            assert np.isclose(p.grad[i], numeric, rtol=1e-5, atol=1e-8), \
                f"{name}{list(i)}: gradient {p.grad[i]:.8g}, central difference {numeric:.8g}"


def test_parameter_names_follow_nanogpt():
    names = [n for n, _ in GPT(GPTConfig(**TINY)).named_parameters()]
    assert names[:4] == ["transformer.wte.weight", "transformer.wpe.weight",
                         "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"]
    for n in ("transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_proj.bias",
              "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
              "transformer.h.0.ln_2.weight", "transformer.ln_f.weight"):
        assert n in names
    assert not any("lm_head" in n for n in names)          # tied to wte
    model = GPT(GPTConfig(**TINY))
    assert model.transformer.h[0].attn.c_attn.weight.shape == (8, 24)   # (in, out)


def test_same_seed_same_weights():
    a, b = GPT(GPTConfig(**TINY), seed=3).state_dict(), GPT(GPTConfig(**TINY), seed=3).state_dict()
    c = GPT(GPTConfig(**TINY), seed=4).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["transformer.wte.weight"], c["transformer.wte.weight"])
    std = a["transformer.h.0.attn.c_proj.weight"].std()
    assert 0.5 * 0.02 / 2 < std < 1.5 * 0.02 / 2                         # 0.02 / sqrt(2 n_layer)


def test_load_state_dict_errors():
    model = GPT(GPTConfig(**TINY))
    state = model.state_dict()
    state["transformer.wpe.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        model.load_state_dict(state)
    del state["transformer.wpe.weight"]
    with pytest.raises(KeyError, match="missing"):
        model.load_state_dict(state)


def test_dropout_masks_are_per_sample():
    model = GPT(GPTConfig(**TINY, dropout=0.3), seed=0)
    x, _ = batch(B=6, seed=2)
    full, _ = model(x, rng=DropoutRNG(5, 9, range(6)))
    sub, _ = model(x[[5, 2]], rng=DropoutRNG(5, 9, [5, 2]))       # sample 5 on another "rank"
    np.testing.assert_array_equal(full.data[5], sub.data[0])
    np.testing.assert_array_equal(full.data[2], sub.data[1])
    other, _ = model(x, rng=DropoutRNG(5, 10, range(6)))          # another step: other masks
    assert not np.array_equal(full.data, other.data)
    model.eval()
    e1, _ = model(x)
    e2, _ = model(x)
    np.testing.assert_array_equal(e1.data, e2.data)


def test_default_dropout_rng_is_deterministic():
    x, y = batch()
    m1, m2 = GPT(GPTConfig(**TINY, dropout=0.2), seed=0), GPT(GPTConfig(**TINY, dropout=0.2), seed=0)
    losses = [[m(x, y)[1].item() for _ in range(2)] for m in (m1, m2)]
    assert losses[0] == losses[1]
    assert losses[0][0] != losses[0][1]


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=10, n_head=3).validate()
    with pytest.raises(ValueError, match="block_size"):
        GPT(GPTConfig(block_size=0))


def test_num_params_generate_and_optimizer():
    model = GPT(GPTConfig(**TINY))
    total = sum(p.size for p in model.parameters())
    assert model.get_num_params() == total - 8 * 8
    out = model.generate(np.zeros((2, 1), dtype=np.int64), 10, top_k=3)
    assert out.shape == (2, 11) and out.max() < 11
    opt = model.configure_optimizers(weight_decay=0.1, lr=1e-3)
    # decayed: wte, wpe, 4 matrices per layer; not: per layer 2 layer norms x (w, b) + 4 biases, ln_f
    assert [len(g["params"]) for g in opt.param_groups] == [2 + 4 * 2, 8 * 2 + 2]


def test_training_lowers_the_loss():
    model = GPT(GPTConfig(**dict(TINY, dtype="float32")), seed=0)
    opt = model.configure_optimizers(weight_decay=0.0, lr=1e-2)
    x, y = batch(B=4)
    losses = []
    for _ in range(20):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert loss.dtype == np.float32
    assert losses[-1] < losses[0] - 0.5
