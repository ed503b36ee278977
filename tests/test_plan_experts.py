"""Mixture of experts in the planner (minidist/plan/experts.py): Mixtral's published
parameter counts, the all-to-all bytes as plan.traffic counts them, the legal rules, and
the experts' memory over expert parallelism."""
from dataclasses import replace

import pytest

from minidist.plan.cluster import make_cluster
from minidist.plan.experts import (MIXTRAL_8X7B_EXPERTS, Experts, all_to_all_bytes, estimate_moe,
                                   expert_state_bytes, legal_moe, params)
from minidist.plan.layout import Layout, Model
from minidist.plan.traffic import moe_bytes

MIXTRAL = Model(32, 4096, 32, 32000, 4096, 256, ffn_hidden=14336, kv_heads=8, swiglu=True)


def test_mixtral_total_and_active_parameters():
    """Mistral AI's figures for Mixtral 8x7B: 46.7B parameters, 12.9B used per token."""
    assert params(MIXTRAL, MIXTRAL_8X7B_EXPERTS) / 1e9 == pytest.approx(46.7, abs=0.05)
    assert params(MIXTRAL, MIXTRAL_8X7B_EXPERTS, active=True) / 1e9 == pytest.approx(12.9, abs=0.05)
    one = Experts(1, 1)                      # one expert, top 1: the dense model plus its router
    assert params(MIXTRAL, one) == MIXTRAL.params() + 32 * 4096


def test_all_to_all_bytes_are_the_traffic_count():
    lay = Layout(2, 1, 32, 2, zero=1, sequence_parallel=True)
    moe = Experts(8, 2, every=2, capacity_factor=1.25)
    m = 256 // (32 * 2)
    want = m * 16 * moe_bytes(2 * 4096 / 2, 2, 4096, 8, 2) * 1.25
    assert all_to_all_bytes(MIXTRAL, moe, lay, 8, 32) == pytest.approx(want, rel=1e-12)
    assert all_to_all_bytes(MIXTRAL, moe, lay, 1, 32) == 0


@pytest.mark.parametrize("moe,ep,lay,word", [
    (Experts(8, 9), 1, Layout(1, 1, 8, 1), "top-k"),
    (Experts(8, 2), 3, Layout(1, 1, 24, 1), "experts"),
    (Experts(8, 2), 8, Layout(1, 2, 4, 1), "dp x cp"),
    (Experts(8, 2, every=3), 1, Layout(1, 1, 8, 1), "layers"),
])
def test_illegal_expert_layouts_say_why(moe, ep, lay, word):
    assert word in legal_moe(MIXTRAL, moe, lay, ep)
    with pytest.raises(ValueError):
        estimate_moe(MIXTRAL, moe, make_cluster("h100-sxm", lay.gpus), lay, ep)


def test_experts_memory_shrinks_with_ep_and_steps_add_the_all_to_all():
    """ep 1 holds all 8 experts (6 more expert widths than the top-2 dense equivalent), ep 8
    one each; the step is the dense equivalent's plus the exposed all-to-all."""
    lay = Layout(1, 4, 16, 1, zero=1, precision="megatron", flash_attention=True)
    cl = make_cluster("h100-sxm", 64)
    one = estimate_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, cl, lay, 1)
    eight = estimate_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, cl, lay, 8)
    expert_w = 8 * 3 * 4096 * 14336 * 2                  # bf16 weights of one expert, 8 layers
    assert one.expert_memory["weights"] == pytest.approx(6 * expert_w, rel=1e-12)
    assert eight.expert_memory["weights"] == pytest.approx(-expert_w, rel=1e-12)
    assert eight.memory_bytes_per_gpu < one.memory_bytes_per_gpu
    assert one.all_to_all_s == 0 < eight.all_to_all_s
    assert eight.step_time_s == pytest.approx(eight.dense.step_time_s + eight.all_to_all_s, rel=1e-12)
    st = expert_state_bytes(MIXTRAL, MIXTRAL_8X7B_EXPERTS, replace(lay, zero=0), 8, 8)
    assert st["optimizer"] == pytest.approx(-expert_w * 6, rel=1e-12)   # 12 B per parameter


def test_search_over_ep_holds_what_is_given_and_the_cli_says_why_not():
    """search_moe tries every ep that divides the experts and dp (held when given); the
    command line runs it with --experts, and refuses --ep alone or an ep the experts
    do not split into, with one line and exit 2."""
    from minidist.plan.__main__ import main
    from minidist.plan.experts import search_moe
    tiny = Model(4, 256, 4, 1000, 128, 32)
    cl = make_cluster("h100-sxm", 8)
    moe = Experts(4, 1)
    every = search_moe(tiny, moe, cl, top=None, tp=1, pp=1, zero=1, recompute="none",
                       micro_batch=1, chunks=1, sequence_parallel=False)
    assert sorted({e.ep for e in every}) == [1, 2, 4]
    held = search_moe(tiny, moe, cl, top=None, ep=2, tp=1, pp=1, zero=1, recompute="none")
    assert held and {e.ep for e in held} == {2}
    assert [e.fits for e in every] == sorted((e.fits for e in every), reverse=True)
    base = ["--gpus", "8", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
            "--seq", "128", "--global-batch", "32"]
    assert main(base + ["--experts", "4", "--top-k", "1", "--tp", "1", "--pp", "1", "--ep", "4",
                        "--only", "--json"]) == 0
    for bad in (["--ep", "2"], ["--experts", "4", "--ep", "3"]):
        with pytest.raises(SystemExit) as exit_:
            main(base + bad)
        assert exit_.value.code == 2


def test_expert_tp_equal_to_tp_is_the_coupled_mapping():
    """etp = tp (cp 1) is Megatron's coupled mapping: the same estimate as etp None."""
    lay = Layout(2, 2, 8, 1, zero=1, sequence_parallel=True, flash_attention=True)
    cl = make_cluster("h100-sxm", 32)
    a = estimate_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, cl, lay, 8)
    b = estimate_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, cl, lay, 8, etp=2)
    assert b.step_time_s == a.step_time_s and b.memory_bytes_per_gpu == a.memory_bytes_per_gpu
    assert b.expert_tp_s == 0


def test_folded_expert_tp_1_by_hand():
    """MoE Parallel Folding, TP 2 with expert TP 1, EP 8 on 16 GPUs: the EP group spans 8
    ranks (NVLink) where the coupled one spans 16 (two nodes); each GPU holds one whole
    expert per layer, its optimizer state sharded over edp = 2 x 8 / 8 = 2; the MLP half of
    each MoE layer's TP messages (3 all-gathers, 2 reduce-scatters of b s h / 2 each) is
    gone from the step."""
    lay = Layout(2, 1, 8, 1, zero=1, sequence_parallel=True, flash_attention=True)
    cl = make_cluster("h100-sxm", 16)
    coupled = estimate_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, cl, lay, 8)
    folded = estimate_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, cl, lay, 8, etp=1)
    m, calls = 256 // 8, 4 * 32 * 7                    # micro-batches; all-to-all calls x steps
    a2a = all_to_all_bytes(MIXTRAL, MIXTRAL_8X7B_EXPERTS, lay, 8, 32)
    alpha, bw = cl.link(8)
    assert folded.all_to_all_s == pytest.approx(m * calls * alpha + a2a / bw, rel=1e-12)
    assert cl.link(16)[1] < bw and coupled.all_to_all_s > folded.all_to_all_s
    p_e = 3 * 4096 * 14336
    st = expert_state_bytes(MIXTRAL, MIXTRAL_8X7B_EXPERTS, lay, 8, 32, etp=1)
    dense = -32 * 2 * p_e / 2                          # the top-2 dense equivalent, cut over tp 2
    assert st["weights"] == pytest.approx(2 * (32 * p_e + dense), rel=1e-12)
    assert st["optimizer"] == pytest.approx(12 * (32 * p_e / 2 + dense / 8), rel=1e-12)
    t_alpha, t_bw = cl.link(2)
    half = 5 * t_alpha + 5 * (4096 * 4096 / 2 * 2) / t_bw   # (t-1)/t of b s h bf16 per call
    assert folded.expert_tp_s == pytest.approx(-m * 32 * half, rel=1e-12)
    assert folded.step_time_s == pytest.approx(folded.dense.step_time_s + folded.all_to_all_s
                                               + folded.expert_dp_s + folded.expert_tp_s, rel=1e-12)


@pytest.mark.parametrize("lay,ep,etp,word", [
    (Layout(2, 1, 8, 1, sequence_parallel=True), 8, 4, "etp x ep"),
    (Layout(2, 1, 8, 1), 8, 1, "sequence parallelism"),
    (Layout(1, 1, 8, 1), 1, 3, "etp x ep"),
])
def test_illegal_expert_tp_says_why(lay, ep, etp, word):
    assert word in legal_moe(MIXTRAL, MIXTRAL_8X7B_EXPERTS, lay, ep, etp)
