"""minidist/plan's formulas against the papers' figures and hand counts, and the exact engine
counts (plan.traffic.*_sent, which the MPI tests hold the counters to) against the papers'
even counts (*_bytes) wherever the ranks divide the shapes: one count from 8 ranks to a
cluster. Serial and fast."""
from fractions import Fraction

import pytest

from minidist import metrics
from minidist.model import GPTConfig
from minidist.parallel import schedules
from minidist.plan import collectives, flops, memory, pipeline, traffic

# (B, s, L, h, V, heads): GPT-3 175B and 1T as Narayanan et al. 2021 Table 1 run them, a small one
GPT_SHAPES = [(1536, 2048, 96, 12288, 51200, 96), (2048, 2048, 128, 25600, 51200, 160),
              (8, 64, 2, 32, 96, 4)]


# ----------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("B, s, L, h, V, heads", GPT_SHAPES)
def test_step_flops_are_narayanans_72_and_96(B, s, L, h, V, heads):
    """Narayanan et al. 2021 (arXiv 2104.04473, section 5.1): 72BsLh^2(1 + s/6h + V/12Lh)
    model FLOPs, 96BsLh^2(1 + s/6h + V/16Lh) with full recomputation; integers, exactly."""
    model, hw_none = flops.step_flops(B, s, L, h, V, heads)
    assert model == hw_none == 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V
    paper = 72 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert model == pytest.approx(paper, rel=1e-12)
    _, full = flops.step_flops(B, s, L, h, V, heads, recompute="full")
    paper = 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert full == pytest.approx(paper, rel=1e-12)
    _, selective = flops.step_flops(B, s, L, h, V, heads, recompute="selective")
    assert selective - model == 4 * B * s * s * h * L      # QK^T and PV once more, every layer


@pytest.mark.parametrize("B, s, L, h, V, heads", GPT_SHAPES)
def test_palm_per_token_agrees_with_the_step_count(B, s, L, h, V, heads):
    """6N + 12LHQT per token x Bs tokens = the 72 formula, N = 12Lh^2 + Vh (the matrices
    and the tied token table; biases and layer norms are what both leave out)."""
    per_token = flops.flops_per_token(L, heads, h // heads, s, 12 * L * h * h + V * h)
    assert per_token * B * s == flops.step_flops(B, s, L, h, V, heads)[0]
    cfg = GPTConfig(block_size=s, vocab_size=V, n_layer=L, n_head=heads, n_embd=h)
    want = flops.flops_per_token(L, heads, h // heads, s, 1234)
    assert metrics.flops_per_token(cfg, 1234) == want


def matmuls(B, s, h, heads, kv_heads, ffn, swiglu):
    """One layer's forward as a list of matrix products (m, k, n), written out by hand."""
    hd = h // heads
    out = [(B * s, h, h), (B * s, h, kv_heads * hd), (B * s, h, kv_heads * hd)]   # Q, K, V
    out += [(s, hd, s)] * (B * heads) + [(s, s, hd)] * (B * heads)             # QK^T, PV per head
    out += [(B * s, h, h)]                                                      # output projection
    out += [(B * s, h, ffn)] * (2 if swiglu else 1) + [(B * s, ffn, h)]        # gate, up; down
    return out


@pytest.mark.parametrize("swiglu, kv_heads, ffn",
                         [(False, 4, 16), (True, 4, 16), (True, 1, 12), (False, 2, 7)])
def test_general_shapes_count_every_matmul(swiglu, kv_heads, ffn):
    """SwiGLU's three MLP matrices and GQA's narrower K and V, against products counted by
    hand (2mkn each): B = 2, s = 3, h = 8, 4 heads, L = 2, V = 11."""
    B, s, h, heads, L, V = 2, 3, 8, 4, 2, 11
    layer = sum(2 * m * k * n for m, k, n in matmuls(B, s, h, heads, kv_heads, ffn, swiglu))
    assert flops.layer_flops(B, s, h, heads, ffn, kv_heads, swiglu) == layer
    model, full = flops.step_flops(B, s, L, h, V, heads, ffn, kv_heads, swiglu, "full")
    assert model == 3 * (L * layer + 2 * B * s * h * V)
    assert full == model + L * layer
    with pytest.raises(ValueError, match="recompute"):
        flops.step_flops(B, s, L, h, V, recompute="some")


def test_swiglu_and_gqa_by_hand():
    """One case small enough to add up on paper: B = 1, s = 2, h = 4, 2 heads, 1 KV head,
    SwiGLU of width 6. Q and O 2*2*4*4 = 64 each, K and V 2*2*4*2 = 32 each, scores
    4*1*2*2*4 = 64, MLP 3 x 2*2*4*6 = 288: 544 per layer."""
    assert flops.layer_flops(1, 2, 4, heads=2, ffn=6, kv_heads=1, swiglu=True) == 544
    assert flops.layer_flops(1, 2, 4, heads=2) == 24 * 2 * 16 + 4 * 4 * 4   # 24Bsh^2 + 4Bs^2h


# ----------------------------------------------------------------------------- memory


def test_zero_papers_example_7_5b_on_64():
    """Rajbhandari et al. 2020, Figure 1: 120, 31.4, 16.6, 1.9 GB per device."""
    gb = [sum(memory.model_state_bytes(7.5e9, 64, stage).values()) / 1e9 for stage in range(4)]
    assert gb[0] == 120.0
    assert [round(x, 1) for x in gb[1:]] == [31.4, 16.6, 1.9]
    s1 = memory.model_state_bytes(7.5e9, 64, 1)
    assert s1 == {"weights": 15e9, "grads": 15e9, "optimizer": 12 * 7.5e9 / 64}


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_megatron_distributed_optimizer_is_6_plus_12_over_d(d):
    assert memory.bytes_per_param("megatron", d, 1) == pytest.approx(6 + 12 / d, rel=1e-15)
    assert memory.bytes_per_param("megatron") == 18
    assert memory.bytes_per_param("zero") == memory.bytes_per_param("fp32") == 16
    with pytest.raises(ValueError, match="stage"):
        memory.model_state_bytes(1e9, d, 4)


def test_bytes_per_param_of_a_tuple_and_the_checkpoints_data():
    """(2, 2, 12), bf16 with 16-bit gradients, 16 B, by hand; a checkpoint's data, weights,
    m and v of 1,000 float64 parameters and the int64 step: 24,000 + 8 B."""
    assert memory.bytes_per_param((2, 2, 12)) == 16
    assert memory.bytes_per_param((2, 4, 12), 4, 1) == 2 + 4 + 3
    assert memory.checkpoint_data_bytes(1000, 8) == 24008
    assert memory.checkpoint_data_bytes(1000, 4) == 12008


def test_best_every_k_is_the_least_of_l_over_k_x_plus_k_a():
    """sqrt(L x / A) by hand (L 16, x 1, A 4: 2); x = A is Chen et al.'s sqrt(L); and no k
    on a fine grid keeps less of (L/k) x + k A than it."""
    assert memory.best_every_k(16, 1, 4) == 2.0
    assert memory.best_every_k(9, 5, 5) == 3.0
    L, x, A = 12, 3, 7
    best = memory.best_every_k(L, x, A)

    def kept(k):
        return L / k * x + k * A

    assert all(kept(best) <= kept(k / 100) for k in range(10, 1300))
    assert kept(best) == pytest.approx(2 * (L * x * A) ** 0.5, rel=1e-15)


def test_engine_state_bytes_adds_stage_1s_local_gradient():
    """This engine's ZeRO-1 keeps the local gradient beside its partition: Psi + Psi/N."""
    psi, n, item = 1200, 4, 8
    assert memory.engine_state_bytes(1, psi, n, item) == \
        {"params": 9600, "grads": 9600 + 2400, "optimizer": 4800}
    assert memory.engine_state_bytes(3, psi, n, item) == \
        {"params": 2400, "grads": 2400, "optimizer": 4800}


# ----------------------------------------------------------------------------- pipeline


def test_bubble_formulas():
    """Narayanan et al. 2021: (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1); ZB-H1's idle time."""
    p, m = 4, 8
    assert pipeline.bubble_fraction("naive", p, m) == Fraction(3, 4)
    assert pipeline.bubble_fraction("gpipe", p, m) == Fraction(3, 11)
    assert pipeline.bubble_fraction("1f1b", p, m) == Fraction(3, 11)
    assert pipeline.bubble_fraction("interleaved", p, m, 2) == Fraction(3, 19)
    assert pipeline.bubble_fraction("interleaved", p, m, 1) == Fraction(3, 11)
    assert pipeline.bubble_fraction("zb-h1", p, m) == Fraction(3, 8 * 3 + 3)    # idle 3(1 + 1 - 1)
    with pytest.raises(ValueError, match="unknown schedule"):
        pipeline.bubble_fraction("2f2b", p, m)


def test_in_flight_is_the_simulators_peak():
    """The first stage's peak of live activations, in micro-batches of its layers: the
    simulator's count (parallel/schedules.py) on every rank, and Korthikanti et al.'s
    p (1 + (p-1)/(p v)) for the first stage once m is large enough."""
    for p in range(1, 7):
        for m in range(1, 13):
            sim = schedules.simulate(schedules.one_f_one_b(p, m), p, m)
            assert sim.peak == [pipeline.live_chunks("1f1b", p, m, 1, r) for r in range(p)], (p, m)
            assert pipeline.in_flight(p, m) == min(p, m) == sim.peak[0]
            if m % p:
                continue
            for v in (2, 3):
                sim = schedules.simulate(schedules.interleaved_1f1b(p, m, v), p, m, v)
                want = [pipeline.live_chunks("interleaved", p, m, v, r) for r in range(p)]
                assert sim.peak == want, (p, m, v)
                assert pipeline.in_flight(p, m, v) == Fraction(sim.peak[0], v)
                if v * m >= v * p + p - 1:
                    assert pipeline.in_flight(p, m, v) == p * (1 + Fraction(p - 1, p * v))


@pytest.mark.parametrize("costs", [(1, 2, 1), (2, 3, 1), (2, 5, 2)])
def test_idle_times_are_the_simulators_on_every_rank(costs):
    """1F1B idles (p-1)(f+B+W), ZB-H1 (p-1)(f+B-W) (Qi et al. 2024, section 2.1) on every
    rank of the simulated schedule, m >= p, for any f, B = b - w, W = w; lesson 04 prints
    them beside its measured F, B, W."""
    f, b, w = costs
    for p in range(1, 6):
        for m in range(p, 10):
            for name in ("1f1b", "zb-h1"):
                sim = schedules.simulate(schedules.build(name, p, m), p, m, costs=costs)
                want = pipeline.idle_time(name, p, f, b - w, w)
                assert [sim.total - x for x in sim.busy] == [want] * p, (name, p, m)
    with pytest.raises(ValueError, match="idle_time knows"):
        pipeline.idle_time("gpipe", 4, 1, 1, 1)


def test_interleaved_warmup_and_latency_are_the_schedules():
    """Rank r runs factor (p-r-1) + (v-1)p forwards, and then its first forward of the
    steady state, before its first backward (at most m v: Megatron-LM's count, and the
    factor-1 variant lesson 04 draws); over p > 1 ranks, messages of up to one cell lengthen
    the step by 2 (pv-1) of them, the fill and the drain only."""
    for p in range(1, 5):
        for m in range(p, 3 * p + 1, p):
            for v in (2, 3):
                for k in (2, 1):
                    sch = schedules.interleaved_1f1b(p, m, v, warmup_factor=k)
                    first_b = [next((i for i, a in enumerate(sch[r]) if a[0] != "F"), len(sch[r]))
                               for r in range(p)]
                    assert first_b == [min(pipeline.warmup_forwards(p, m, v, r, k) + 1, m * v)
                                       for r in range(p)], (p, m, v, k)
                if p == 1:                      # one rank: its chunks send no messages
                    continue
                sch = schedules.interleaved_1f1b(p, m, v)
                free = schedules.simulate(sch, p, m, v).total
                for lam in (Fraction(1, 4), Fraction(1)):
                    late = schedules.simulate(sch, p, m, v, latency=lam / v).total
                    assert (late - free) * v == pipeline.latency_fill_drain(p, v, lam), (p, m, v, lam)


def test_step_p2p_bytes_is_the_sum_of_every_stages_count():
    """2 (pv-1) m b s h itemsize: traffic.pp_sent summed over the p v virtual stages."""
    b, s, h, item, m = 2, 8, 16, 8, 4
    for p, v in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 3)):
        total = sum(traffic.pp_sent([k], p * v, [b] * m, s, h, item) for k in range(p * v))
        assert pipeline.step_p2p_bytes(p, v, m, b, s, h, item) == total, (p, v)
    assert pipeline.bubble_text("interleaved", 1) == pipeline.bubble_text("1f1b") == "(p-1)/(m+p-1)"


# ----------------------------------------------------------------------------- memory: lessons 03-06


def test_zero_gradient_peak_by_stage():
    """Stage 0 holds Psi, stage 1 Psi + Psi/N (engine_state_bytes' gradients: the same rule);
    stage 2 Psi until backward ends (+ Psi/N with micro-batches); the overlapped stage 2
    and stage 3 bounds add what is in flight to Psi/N."""
    psi, n, item = 1200, 4, 8
    for stage in (0, 1):
        assert memory.zero_grad_peak_bytes(stage, psi, n, item) == \
            memory.engine_state_bytes(stage, psi, n, item)["grads"]
    assert memory.zero_grad_peak_bytes(2, psi, n, item) == 9600
    assert memory.zero_grad_peak_bytes(2, psi, n, item, micro_batches=2) == 9600 + 2400
    assert memory.zero_grad_peak_bytes(2, psi, n, item, overlap=True, block=100, filling=64) == 2400 + 800 + 64
    assert memory.zero_grad_peak_bytes(3, psi, n, item, root=300, block=100) == 2400 + 3200


def test_fsdp_gathered_units_tp_weights_and_kv_cache():
    """FSDP's peak: the root and the largest block (two with prefetch), every unit without
    resharding. TP weights: 1/t of the sharded values and every replicated one. KV cache:
    2 b s L h values, 1/t per rank."""
    units = [50, 30, 70, 40]
    assert memory.fsdp_gathered_units(units, prefetch=False) == [50, 70]
    assert memory.fsdp_gathered_units(units) == [50, 70, 40]
    assert memory.fsdp_gathered_units(units[:2]) == [50, 30]               # one block: nothing to prefetch
    assert memory.fsdp_gathered_units(units, reshard=False) == units
    assert memory.tp_weight_bytes(sharded=1000, replicated=24, t=4, itemsize=2) == (250 + 24) * 2
    assert memory.kv_cache_bytes(1, 16, 2, 32, 8) == 2 * 16 * 2 * 32 * 8
    assert memory.kv_cache_bytes(3, 16, 2, 32, 8, t=4) == 3 * 2 * 16 * 2 * 32 * 8 // 4


# ----------------------------------------------------------------------------- collectives: lesson 01


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_alpha_beta_terms_are_the_time_formulas(n):
    """The coefficients lesson 01 prints are the time functions' own: messages, bytes sent
    and bytes added per byte of M (the fold of N - P ranks apart); and the ring's
    2(N-1)/N M is the exact count where N divides the vector."""
    for name, time in collectives.ALL_REDUCE_TIMES.items():
        fold = 0 if name == "ring" else 1
        a, b, g = collectives.alpha_beta_terms(name, n)
        extra = fold * (n != collectives.power_of_two_below(n))       # 2 alpha + 2 M beta + M gamma
        assert time(1000, n, 1, 0, 0) == a + 2 * extra, name
        assert time(1000, n, 0, 1, 0) == pytest.approx(1000 * (b + 2 * extra), rel=1e-12), name
        assert time(1000, n, 0, 0, 1) == pytest.approx(1000 * (g + extra), rel=1e-12), name
    with pytest.raises(ValueError, match="unknown all-reduce"):
        collectives.alpha_beta_terms("tree", n)
    item = 8
    for r in range(n):
        assert collectives.ring_all_reduce_sent(12 * n, n, r) * item == \
            collectives.ring_all_reduce_bytes(12 * n * item, n)


# ------------------------------------------------------- traffic: exact = paper where it divides


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_exact_count_is_the_papers_where_t_divides(t):
    """4 all-reduces of bsh per layer (8bsh(t-1)/t): the engine's count of L layers without
    the ends, the loss or clipping; under SP with the gathered inputs kept, 4 all-gathers
    and 4 reduce-scatters, the same bytes (regathering adds 2 all-gathers per layer)."""
    b, s, h, L, item = 2, 16, 24, 3, 2
    for r in range(t):
        plain = traffic.tp_sent(b, s, h, L, t, r, item, first=False, last=False, clip=False)
        assert plain == {"all_reduce": (4 * L, L * traffic.tp_layer_bytes(b, s, h, t, item))}
        ends = dict(first=False, last=False, clip=False)
        sp = traffic.tp_sent(b, s, h, L, t, r, item, sequence_parallel=True, regather=False, **ends)
        paper = L * traffic.tp_layer_bytes(b, s, h, t, item, True)
        assert sp["all_gather"][1] + sp["reduce_scatter"][1] == paper
        again = traffic.tp_sent(b, s, h, L, t, r, item, sequence_parallel=True, **ends)
        assert again["all_gather"][1] == 1.5 * sp["all_gather"][1]
        regathered = L * traffic.tp_layer_bytes(b, s, h, t, item, True, regather=True)
        assert again["all_gather"][1] + again["reduce_scatter"][1] == regathered
        assert regathered == L * traffic.tp_layer_elements(b, s, h, t, regather=True) * item


def test_tp_layer_elements_by_hand():
    """b s h = 768 at t = 4: 8 x 768 x 3/4 = 4,608 elements, 5,760 with the regather; the
    regather needs sequence parallelism in the bytes form (plain TP has no all-gather)."""
    assert traffic.tp_layer_elements(2, 16, 24, 4) == 4608
    assert traffic.tp_layer_elements(2, 16, 24, 4, regather=True) == 5760
    assert traffic.tp_layer_bytes(2, 16, 24, 4, 2, regather=True) == 2 * 4608
    assert traffic.tp_layer_bytes(2, 16, 24, 4, 2, True, regather=True) == 2 * 5760


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_and_dp_exact_counts_are_the_papers_where_n_divides(n):
    """ZeRO 1 and 2: 2 (N-1)/N Psi; 3: 3 (N-1)/N Psi less the root unit's second gather
    (Rajbhandari et al. 2020, section 7); plain DP's all-reduce 2 (N-1)/N Psi."""
    units = [8 * n * k for k in (5, 3, 3)]             # the root unit, then two blocks
    psi, item, k = sum(units), 4, 3
    groups = [(u, item, item) for u in units]
    for r in range(n):
        for stage in (1, 2):
            want = traffic.zero_bytes(stage, psi, n, item, k)
            assert sum(traffic.zero_sent(stage, groups, n, r, k).values()) == want
        assert sum(traffic.zero_sent(3, groups, n, r, k).values()) == \
            traffic.zero_bytes(3, psi, n, item, k, root=units[0])
        assert sum(traffic.zero_sent(3, groups, n, r, k, reshard=False).values()) == \
            traffic.zero_bytes(3, psi, n, item, k, reshard=False)
        assert traffic.dp_sent(units, n, r, item) == (3, traffic.dp_bytes(psi, n, item))


def test_pipeline_and_moe_counts():
    """PP: b s h per micro-batch per boundary each way; an inner stage sends both ways, the
    ends one way. MoE: even routing sends (ep-1)/ep of the rows out, as many come in."""
    b, s, h, item, m, p = 2, 8, 16, 8, 4, 4
    one = pipeline.p2p_bytes(b, s, h, item)
    got = [traffic.pp_sent([r], p, [b] * m, s, h, item) for r in range(p)]
    assert got == [m * one, 2 * m * one, 2 * m * one, m * one]
    assert traffic.pp_sent([0, 4], 8, [b] * m, s, h, item) == 3 * m * one    # chunks 0 and 4 of 8
    tokens, k, ep = 64, 2, 4
    rows = tokens * k * (ep - 1) // ep
    assert traffic.moe_sent(rows, rows, h, item) == traffic.moe_bytes(tokens, k, h, ep, item)
