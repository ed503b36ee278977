"""Activation memory by the model's shape and Llama 3's FSDP (minidist/plan/memory.py):
Korthikanti et al.'s GPT count kept exactly for GPT's shape, the SwiGLU / GQA / no-dropout
terms for Llama's, FSDP as Llama 3's section 3.3.2 describes it (ZeRO-2), and the cost
model's memory on the 405B layout recomputed from those parts."""
import pytest

from minidist.plan.cluster import make_cluster
from minidist.plan.cost import estimate
from minidist.plan.layout import Layout, Model, layout_stages, legal
from minidist.plan.memory import (FSDP_ZERO_STAGE, LLAMA3_FSDP_ZERO, accumulator_bytes,
                                  activation_layer_bytes,
                                  korthikanti_layer_bytes, layer_activation_bytes,
                                  layer_activation_terms, model_state_bytes)
from minidist.plan.pipeline import live_chunks

GPT_SHAPES = [(2048, 1, 6144, 64), (2048, 4, 12288, 96), (4096, 2, 4096, 32)]   # s, b, h, a
L405 = dict(ffn=53248, kv_heads=8, swiglu=True, dropout=False, flash_attention=True)


@pytest.mark.parametrize("s,b,h,a", GPT_SHAPES)
@pytest.mark.parametrize("t,sp", [(1, False), (8, False), (8, True), (4, True)])
def test_gpt_shape_is_korthikanti(s, b, h, a, t, sp):
    """GPT's shape (f = 4h, a_kv = a, GELU, dropout) gives their eq. 1, 2, 4 exactly, and
    activation_layer_bytes under every recomputation and attention core."""
    terms = layer_activation_terms(s, b, h, a, t, sp)
    assert sum(terms.values()) == korthikanti_layer_bytes(s, b, h, a, t, sp)
    for rc in ("none", "selective", "full"):
        assert layer_activation_bytes(s, b, h, a, t, sp, rc) == activation_layer_bytes(s, b, h, a, t, sp, rc)
    assert (layer_activation_bytes(s, b, h, a, t, sp, flash_attention=True)
            == pytest.approx(activation_layer_bytes(s, b, h, a, t, sp, attention="blockwise"), rel=1e-12))
    # the explicit GPT shape is the default one
    assert (layer_activation_bytes(s, b, h, a, t, sp, ffn=4 * h, kv_heads=a, swiglu=False, dropout=True)
            == korthikanti_layer_bytes(s, b, h, a, t, sp))


def test_no_dropout_drops_masks_and_one_score_copy():
    s, b, h, a = 2048, 1, 4096, 32
    assert layer_activation_bytes(s, b, h, a, dropout=False) == 32 * s * b * h + 2 * a * s * s * b


def test_llama_405b_layer_count():
    """12sbh + 4sb h_kv + 6sbf + 4asb at t = 1; everything / t under SP: 31.78 sbh/t for 405B
    (GPT's count says 34sbh/t)."""
    s, b, h, a, f = 8192, 1, 16384, 128, 53248
    h_kv = 8 * h // a
    one = layer_activation_bytes(s, b, h, a, 1, False, **L405)
    assert one == 12 * s * b * h + 4 * s * b * h_kv + 6 * s * b * f + 4 * a * s * b
    eight = layer_activation_bytes(s, b, h, a, 8, True, **L405)
    assert eight == pytest.approx(one / 8, rel=1e-12)
    assert (eight - 4 * a * s * b / 8) / (s * b * h / 8) == pytest.approx(31.75)
    terms = layer_activation_terms(s, b, h, a, 8, True, **L405)
    assert terms["attention dropout mask"] == terms["MLP dropout mask"] == 0
    assert terms["gate, up outputs"] == 2 * terms["gate x up (down's input)"] == 4 * s * b * f / 8
    assert "scores (softmax output, masks)" not in terms


def test_model_dropout_default_follows_shape():
    assert Model(2, 64, 4, 100, 16, 8).has_dropout
    assert not Model(2, 64, 4, 100, 16, 8, swiglu=True).has_dropout
    assert Model(2, 64, 4, 100, 16, 8, swiglu=True, dropout=True).has_dropout
    assert not Model(2, 64, 4, 100, 16, 8, dropout=False).has_dropout


def test_llama3_fsdp_is_zero2():
    """Section 3.3.2: optimizer states and gradients sharded, weights not resharded after
    forward: whole 16-bit weights, fp32 gradients and Adam's 12 B cut over N_d."""
    assert LLAMA3_FSDP_ZERO == FSDP_ZERO_STAGE["SHARD_GRAD_OP"] == 2
    st = model_state_bytes(1e9, 64, LLAMA3_FSDP_ZERO, "megatron")
    assert st == {"weights": 2e9, "grads": 4e9 / 64, "optimizer": 12e9 / 64}


@pytest.mark.parametrize("gpus,flight", [(8192, 141), (16384, 128)])
def test_llama_405b_memory_from_parts(gpus, flight):
    """The 405B pre-training layout (Table 4: TP 8, PP 16, DP gpus/128, 8 chunks, micro-batch
    1) under ZeRO-2: the second stage (8 layers, Megatron's warm-up) is the fullest; its
    memory is its states plus flight x layer_activation_bytes, nothing else."""
    model = Model(126, 16384, 128, 128256, 8192, 2048, ffn_hidden=53248, kv_heads=8, swiglu=True)
    lay = Layout(8, 16, gpus // 128, 1, chunks=8, zero=LLAMA3_FSDP_ZERO, sequence_parallel=True,
                 precision="megatron", flash_attention=True)
    est = estimate(model, make_cluster("h100-sxm", gpus), lay)
    m = 2048 // (gpus // 128)
    assert live_chunks("interleaved", 16, m, 8, 1) == flight and layout_stages(model, lay)[1] == 8
    per_layer = layer_activation_bytes(8192, 1, 16384, 128, 8, True, **L405)
    assert est.memory["activations"] == pytest.approx(flight * per_layer, rel=1e-12)
    assert est.memory["grads"] == pytest.approx(est.memory["weights"] * 2 / (gpus // 128), rel=1e-12)
    zero1 = estimate(model, make_cluster("h100-sxm", gpus), Layout(
        8, 16, gpus // 128, 1, chunks=8, zero=1, sequence_parallel=True, precision="megatron",
        flash_attention=True))
    assert zero1.memory["grads"] == 2 * zero1.memory["weights"]          # whole fp32 gradients
    assert est.memory_bytes_per_gpu < zero1.memory_bytes_per_gpu - 12e9


@pytest.mark.parametrize("gpus", [8192, 16384])
def test_llama3_accumulates_a_chunk_then_reduce_scatters_once_per_group(gpus):
    """Llama 3's mapping (plan.memory.LLAMA3_FSDP_ZERO, Layout.accumulate = N = 16): the
    gradients' reduce-scatters fall from m per step to m / 16, the bytes with them, and
    one chunk's whole fp32 gradient (accumulator_bytes) joins the sharded states; the
    published rows use exactly this layout, and their memory says why they do not fit."""
    from minidist.plan.published import ROWS
    model = Model(126, 16384, 128, 128256, 8192, 2048, ffn_hidden=53248, kv_heads=8, swiglu=True)
    base = dict(chunks=8, zero=LLAMA3_FSDP_ZERO, sequence_parallel=True, precision="megatron",
                flash_attention=True)
    cl, d = make_cluster("h100-sxm", gpus), gpus // 128
    every = estimate(model, cl, Layout(8, 16, d, 1, **base))
    grouped = estimate(model, cl, Layout(8, 16, d, 1, accumulate=16, **base))
    m = 2048 // d
    assert every.bytes_sent["dp"] > grouped.bytes_sent["dp"]
    rs = every.bytes_sent["dp"] - grouped.bytes_sent["dp"]     # (m - m/16) reduce-scatters' bytes
    ag = grouped.bytes_sent["dp"] - rs * (m // 16) / (m - m // 16)
    assert ag > 0 and every.bytes_sent["dp"] == pytest.approx(ag + rs * m / (m - m // 16), rel=1e-12)
    psi = grouped.memory["weights"] / 2                           # bf16 weights, whole
    assert grouped.memory["grads"] == pytest.approx(every.memory["grads"] + accumulator_bytes(psi, 8),
                                                    rel=1e-12)
    assert accumulator_bytes(psi, 8) == pytest.approx(4 * psi / 8, rel=1e-12)
    assert grouped.dp_s <= every.dp_s
    row = next(r for r in ROWS if r.label == f"405B on {gpus}")
    assert row.layout == Layout(8, 16, d, 1, accumulate=16, **base)
    # 90% of the H100's 85.5e9 bytes: 16,384 GPUs (16 micro-batches) fit, 8,192 (32) do not
    assert grouped.fits == (gpus == 16384) and grouped.memory["activations"] > (72e9 if gpus == 8192 else 62e9)


def test_accumulate_needs_zero2_and_a_divisor():
    model = Model(8, 64, 4, 100, 16, 32)
    cl = make_cluster("h100-sxm", 8)
    assert "ZeRO 2" in legal(model, cl, Layout(1, 2, 4, 1, zero=1, accumulate=2))
    assert "ZeRO 2" in legal(model, cl, Layout(1, 2, 4, 1, zero=2, accumulate=3))
    assert legal(model, cl, Layout(1, 2, 4, 1, zero=2, accumulate=4)) is None
