"""minidist's GPT and nanoGPT's give the same logits for the same weights.

    python -m pytest -q tests/test_nanogpt.py

nanoGPT's MLP runs PyTorch's exact nn.GELU(), x Phi(x); GPTConfig(gelu="erf") computes
it with a hand-written erf (W. J. Cody's rational approximations, minidist/fused.py),
checked here against math.erf. PyTorch is not installed here, so nanoGPT's forward is
rewritten below in NumPy from karpathy/nanoGPT model.py (LayerNorm eps 1e-5, causal
attention scaled by 1/sqrt(head size), lm_head tied to wte, Linear as x @ W.T + b) and
reads the exported safetensors file exactly as nanoGPT's load_state_dict would.
"""
import json
import math

import numpy as np
import pytest

from minidist import ops
from minidist.checkpoint import format as st
from minidist.checkpoint.cli import main as checkpoint_main
from minidist.model import GPT, GPTConfig
from minidist.tensor import Tensor

CFG = dict(block_size=8, vocab_size=24, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
_erf = np.vectorize(math.erf)
_erfc = np.vectorize(math.erfc)

# ----------------------------------------------------------------------------- erf


def test_erf_and_erfc_match_math_to_float64_rounding():
    x = np.concatenate([np.linspace(-27, 27, 20001), np.logspace(-300, 1.4, 2000),
                        -np.logspace(-300, 1.4, 2000), [0.0, 0.5, -0.5, 4.0, -4.0,
                                                        np.nextafter(0.5, 1), np.nextafter(4.0, 5)]])
    want = _erf(x)
    got = ops.erf(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    rel = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(float).tiny)
    assert rel.max() <= 2e-15, f"erf off by {rel.max():.2e} relative at x = {x[rel.argmax()]}"
    want = _erfc(x)
    normal = want > np.finfo(float).tiny                   # below it: subnormal, few digits
    rel = np.abs(ops.erfc(x)[normal] - want[normal]) / want[normal]
    assert rel.max() <= 2e-15, f"erfc off by {rel.max():.2e} relative at x = {x[normal][rel.argmax()]}"
    assert np.all(ops.erfc(np.array([27.5, 40.0])) == 0.0)
    x32 = np.linspace(-6, 6, 1001, dtype=np.float32)
    assert ops.erf(x32).dtype == np.float32
    assert np.abs(ops.erf(x32) - _erf(x32.astype(np.float64))).max() <= 2e-7
    x16 = np.linspace(-60000, 60000, 2001).astype(np.float16)      # float16: computed in float32
    with np.errstate(over="raise", invalid="raise"):
        got16 = ops.erf(x16)
    assert got16.dtype == np.float16 and np.abs(got16 - _erf(x16.astype(np.float64))).max() <= 1e-3


def test_gelu_erf_forward_and_backward_are_x_phi_and_its_derivative():
    """Relative to float64 rounding; far below 0 Phi(x) is erfc(|x| / sqrt 2) / 2, whose
    condition number x^2 multiplies the rounding of x / sqrt 2 (any implementation's)."""
    x = np.linspace(-37, 12, 4901)
    phi_cdf = 0.5 * _erfc(-x / math.sqrt(2))
    t = Tensor(x.copy(), requires_grad=True)
    y = ops.gelu(t, "erf")
    want = x * phi_cdf
    rel = np.abs(y.data - want) / np.where(want == 0, 1.0, np.abs(want))
    assert rel[x >= -10].max() <= 2e-14 and rel.max() <= 5e-13, f"x Phi(x): {rel.max():.2e} relative"
    g = np.random.default_rng(0).normal(size=x.shape)
    y.backward(g)
    dwant = (phi_cdf + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)) * g
    assert np.max(np.abs(t.grad - dwant)) <= 1e-15 * np.abs(g).max(), "Phi(x) + x phi(x)"
    # and against central differences of the forward (the derivative is the forward's)
    h, xs = 1e-6, np.linspace(-5, 5, 101)
    fd = (ops.gelu(Tensor(xs + h), "erf").data - ops.gelu(Tensor(xs - h), "erf").data) / (2 * h)
    assert np.allclose(ops.gelu_erf_backward(xs, np.ones_like(xs)), fd, rtol=0, atol=1e-8)
    with pytest.raises(ValueError, match="tanh, erf"):
        ops.gelu(t, "exact")

# ----------------------------------------------------------------------------- nanoGPT's forward


def _layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)                   # biased, as F.layer_norm
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def nanogpt_logits(sd, cfg, idx, gelu="erf"):
    """nanoGPT's GPT.forward(idx, targets) logits, in NumPy, on its state dict `sd`."""
    B, T = idx.shape
    C, nh = cfg["n_embd"], cfg["n_head"]
    hs = C // nh
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        lin = lambda h, n: h @ sd[p + n + ".weight"].T + sd[p + n + ".bias"]   # noqa: E731
        h = _layer_norm(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
        q, k, v = np.split(lin(h, "attn.c_attn"), 3, axis=2)
        q, k, v = (a.reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + lin(y, "attn.c_proj")
        h = lin(_layer_norm(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"]), "mlp.c_fc")
        if gelu == "erf":                                            # nn.GELU()
            h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
        else:                                                        # nn.GELU(approximate="tanh")
            h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
        x = x + lin(h, "mlp.c_proj")
    x = _layer_norm(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"])
    return x @ sd["lm_head.weight"].T


def trained_like(gelu, seed=0):
    """A float64 minidist GPT with weights large enough that GELU's form shows in the logits
    (0.02-scale initial weights keep every GELU input near 0, where the forms agree)."""
    model = GPT(GPTConfig(**CFG, gelu=gelu, dtype="float64"), seed=seed)
    g = np.random.default_rng(seed + 1)
    for name, p in model.named_parameters():
        p.data = (1.0 if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") else 0.0) + \
            g.normal(0, 0.6 if p.data.ndim == 2 else 0.2, size=p.shape)
    return model


def as_nanogpt_state(model, compiled=False):
    """The model's weights as nanoGPT's safetensors.torch.save_model writes them: PyTorch's
    (out, in) Linear weights, the tied pair under lm_head.weight only."""
    sd = {}
    for name, a in model.state_dict().items():
        a = a.T if a.ndim == 2 and name not in ("transformer.wte.weight", "transformer.wpe.weight") else a
        sd["lm_head.weight" if name == "transformer.wte.weight" else name] = np.ascontiguousarray(a)
    return {"_orig_mod." + n if compiled else n: a for n, a in sd.items()}


def _run(argv, capsys):
    code = checkpoint_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("gelu", ["erf", "tanh"])
def test_import_then_export_gives_nanogpt_the_same_logits(gelu, tmp_path, capsys):
    """A nanoGPT state dict (torch.compile's prefix, lm_head only) in; the export's file and
    metadata build nanoGPT's model; its logits equal minidist's to float64 rounding."""
    model = trained_like(gelu)
    model.config.n_head = CFG["n_head"]
    src = tmp_path / "nanogpt.safetensors"
    meta = {"format": "pt", "nanogpt_config": json.dumps({"n_head": CFG["n_head"]}), "gelu": gelu}
    st.write_safetensors(src, as_nanogpt_state(model, compiled=True), meta)
    code, out, err = _run(["import", src, tmp_path / "ckpt"], capsys)
    assert code == 0, err
    code, out, err = _run(["export", tmp_path / "ckpt", tmp_path / "out.safetensors"], capsys)
    assert code == 0, err
    assert all(len(line) <= 100 for line in out.splitlines()), out
    sd = st.read_safetensors(tmp_path / "out.safetensors")
    header = st.read_header(tmp_path / "out.safetensors")["__metadata__"]
    cfg = json.loads(header["nanogpt_config"])
    assert {k: cfg[k] for k in CFG if k != "dropout"} == {k: v for k, v in CFG.items() if k != "dropout"}
    assert header["gelu"] == gelu
    idx = np.random.default_rng(2).integers(0, CFG["vocab_size"], (3, CFG["block_size"]))
    ours = model(idx)[0].data
    theirs = nanogpt_logits(sd, cfg, idx, gelu=header["gelu"])
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert rel <= 1e-12, f"{gelu}: minidist's logits differ from nanoGPT's by {rel:.2e} (max, relative)"
    other = nanogpt_logits(sd, cfg, idx, gelu="tanh" if gelu == "erf" else "erf")
    gap = np.abs(ours - other).max() / np.abs(theirs).max()
    assert gap > 1e-5, f"the other GELU should show in these logits, it differs by only {gap:.1e}"


def test_export_bfloat16_and_float32(tmp_path, capsys):
    model = trained_like("erf")
    src = tmp_path / "in.safetensors"
    st.write_safetensors(src, as_nanogpt_state(model))
    assert _run(["import", src, tmp_path / "ckpt"], capsys)[0] == 0
    for dtype, code in (("float32", "F32"), ("bfloat16", "BF16")):
        out = tmp_path / f"{dtype}.safetensors"
        assert _run(["export", "--dtype", dtype, tmp_path / "ckpt", out], capsys)[0] == 0
        header = st.read_header(out)
        assert {e["dtype"] for n, e in header.items() if n != "__metadata__"} == {code}
        w = st.read_safetensors(out)["transformer.h.0.mlp.c_fc.weight"]
        want = model.state_dict()["transformer.h.0.mlp.c_fc.weight"].T.astype(np.float32)
        ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -24     # half an ulp, relative
        assert np.all(np.abs(w.astype(np.float64) - want) <= ulp * np.abs(want)), dtype
    with pytest.raises(SystemExit):                      # argparse: float32 or bfloat16 only
        checkpoint_main(["export", "--dtype", "float16", str(tmp_path / "ckpt"), str(out)])


def test_import_refuses_what_is_not_a_gpt_in_one_line(tmp_path, capsys):
    model = trained_like("tanh")
    good = as_nanogpt_state(model)
    cases = {
        "notes.txt": b"not weights at all\n" * 4,
        "ckpt.pt": b"PK\x03\x04" + bytes(200),                          # torch.save's zip
        "adam.safetensors": {"exp_avg.0": np.zeros(3, np.float32)},
        "wrong_shape.safetensors": {**good, "transformer.h.0.mlp.c_fc.weight": np.zeros((5, 16))},
        "no_pos.safetensors": {n: a for n, a in good.items() if n != "transformer.wpe.weight"},
        "ints.safetensors": {**good, "transformer.ln_f.bias": np.zeros(16, np.int64)},
    }
    for name, content in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            st.write_safetensors(path, content)
        code, out, err = _run(["import", path, tmp_path / "root"], capsys)
        assert code == 2 and not out, (name, out)
        assert err.startswith("error: ") and err.count("\n") == 1, (name, err)
    assert "torch.save" in _run(["import", tmp_path / "ckpt.pt", tmp_path / "root"], capsys)[2]
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
