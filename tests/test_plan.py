"""The planner (minidist/plan/cluster.py, cost.py, search.py, published.py, __main__.py): the
legal-layout rules, bad input (one line, exit 2), the 70B search, the CLI's JSON, the
fixed Llama 3 layout, and the published comparison recomputed from the model's parts;
context parallelism (--cp): its bytes from plan.context, memory and compute per GPU
falling with cp, the gradients' dp x cp group, and Llama 3's 128K row."""
import json

import pytest

from minidist.plan import flops
from minidist.plan.__main__ import main
from minidist.plan.cluster import GPUS, make_cluster
from minidist.plan.collectives import ring_all_reduce_time
from minidist.plan.cost import estimate
from minidist.plan.layout import Layout, Model, layout_stages, legal, model_from_params, stage_layers
from minidist.plan.memory import activation_layer_bytes, model_state_bytes
from minidist.plan.pipeline import in_flight
from minidist.plan.published import ROWS, compare
from minidist.plan.search import layouts, search

LLAMA = ["--gpus", "8192", "--gpu", "h100-sxm", "--tp", "8", "--pp", "16", "--layers", "126",
         "--hidden", "16384", "--heads", "128", "--kv-heads", "8", "--ffn-hidden", "53248",
         "--vocab", "128256", "--swiglu", "--seq", "8192", "--global-batch", "2048"]
JSON_KEYS = {"tp", "pp", "dp", "micro_batch", "step_time_s", "tflops_per_gpu_model",
             "tflops_per_gpu_hardware", "mfu", "hfu", "memory_bytes_per_gpu", "fits"}


def run(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr()


def test_seed_70b_model_states_are_16_bytes_per_parameter():
    states = model_state_bytes(70e9, 1, 0, "zero")
    assert sum(states.values()) == 1.12e12, "70B at 2 + 2 + 12 bytes per parameter is 1.12 TB, not 560 GB"
    assert sum(states.values()) > GPUS["h200"].memory_bytes


def test_datasheet_peaks_are_dense():
    assert GPUS["a100-80gb"].peak_flops == 312e12 and GPUS["h100-sxm"].peak_flops == 989e12
    # memory: nvidia-smi's totals in MiB, the datasheets' "80 GB" and "141 GB" rounded
    assert [GPUS[g].memory_bytes for g in ("a100-80gb", "h100-sxm", "h200")] == [81920 * 2 ** 20, 81559 * 2 ** 20,
                                                                                  143771 * 2 ** 20]


@pytest.mark.parametrize("layout, words", [
    (Layout(4, 1, 8, 1), "tp x pp x dp"),
    (Layout(3, 8, 1, 1), "does not divide the 64 heads"),
    (Layout(8, 3, 1, 1), "does not divide the 80 layers"),
    (Layout(8, 1, 3, 1), "global batch"),
    (Layout(1, 24, 1, 1), "layers"),
    (Layout(1, 4, 6, 1, sequence_parallel=True), "sequence parallelism needs tp > 1"),
    (Layout(8, 1, 3, 1, chunks=2), "chunks"),
])
def test_legal_names_the_rule_broken(layout, words):
    model = Model(80, 8192, 64, 51200, 4096, 1000 if words == "global batch" else 1536)
    cluster = make_cluster("h100-sxm", 24)
    why = legal(model, cluster, layout)
    assert why is not None and words in why, why


def test_llama3_stage_layout_and_pipeline_rules():
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]       # one layer fewer at each end
    assert stage_layers(80, 8) == [10] * 8 and stage_layers(80, 3) is None


def test_search_space_is_legal_and_tp_stays_in_a_node():
    model, cluster = model_from_params(70e9), make_cluster("h100-sxm", 1024)
    seen = list(layouts(model, cluster))
    assert seen and all(legal(model, cluster, lay) is None for lay in seen)
    assert all(lay.tp <= 8 and lay.tp * lay.pp * lay.dp == 1024 for lay in seen)
    assert {lay.tp for lay in seen} == {1, 2, 4, 8} and {lay.zero for lay in seen} == {0, 1, 2, 3}
    assert all(sum(layout_stages(model, lay)) == model.layers and len(layout_stages(model, lay)) == lay.pp
               and model.global_batch % (lay.dp * lay.micro_batch) == 0 for lay in seen)


def test_70b_on_1024_h100_best_layouts_fit_with_tp_at_most_8():
    model = model_from_params(70e9)
    assert (model.hidden, model.heads, model.layers) == (8192, 64, 88)
    best = search(model, make_cluster("h100-sxm", 1024), top=5)
    assert len(best) == 5 and all(e.fits and e.layout.tp <= 8 for e in best)
    assert [e.step_time_s for e in best] == sorted(e.step_time_s for e in best)


def test_estimate_adds_up():
    model = Model(80, 8192, 64, 51200, 4096, 512)
    cluster = make_cluster("h100-sxm", 256)
    lay = Layout(8, 4, 8, 1, chunks=2, zero=1, sequence_parallel=True, recompute="selective")
    e = estimate(model, cluster, lay)
    parts = e.compute_s + e.tp_s + e.bubble_s + e.pp_s + e.dp_s + e.optimizer_s
    assert e.step_time_s == pytest.approx(parts, rel=1e-12)
    assert e.mfu == pytest.approx(e.model_flops / (e.step_time_s * 256 * 989e12), rel=1e-12)
    m = 512 // 8
    keep = activation_layer_bytes(4096, 1, 8192, 64, 8, True, "selective")
    first = float(in_flight(4, m, 2)) * 20 * keep       # p (1 + (p-1)/(p v)) micro-batches of 20 layers
    assert "logits" not in e.memory, "the first stage, not the last, is the fullest here"
    assert e.memory["activations"] == pytest.approx(first, rel=1e-12)
    assert e.memory_bytes_per_gpu == pytest.approx(sum(e.memory.values()), rel=1e-12)


def test_dp_reduce_overlaps_only_the_last_backward():
    model = Model(24, 2304, 24, 51200, 2048, 512)
    cluster = make_cluster("a100-80gb", 32, contention=False)    # one NIC's bandwidth per GPU
    e = estimate(model, cluster, Layout(1, 1, 32, 1, recompute="full", precision="zero"))
    psi = model.params()
    reduce_s = ring_all_reduce_time(psi * 2, 32, cluster.inter_alpha, 1 / cluster.inter_bw)
    per_mb = e.compute_s / 16
    backward = per_mb * 3 / 4                                   # full recompute: 1 + 2 of 4 passes
    assert e.dp_s == pytest.approx(reduce_s - backward, rel=1e-9)


@pytest.mark.parametrize("argv, words", [
    (["--params", "70e9", "--gpus", "1020"], "not a multiple of the node size"),
    (["--params", "70e9", "--gpus", "1024", "--gpu", "v100"], "invalid choice"),
    (["--params", "70e9", "--gpus", "1024", "--tp", "3"], "does not divide the 64 heads"),
    (["--params", "70e9", "--gpus", "1024", "--tp", "8", "--pp", "3"], "does not divide the 1024 GPUs"),
    (["--layers", "80", "--hidden", "8192", "--heads", "64", "--gpus", "24", "--tp", "8", "--pp", "3",
      "--only"], "does not divide the 80 layers"),
    (["--params", "70e9", "--gpus", "8", "--gpu", "a100-80gb"], "fits no layout"),
    (["--gpus", "8"], "give --params or a shape"),
    (["--params", "70e9", "--gpus", "1024", "--cp", "3"], "2 x cp = 6 equal chunks"),
    (["--params", "70e9", "--gpus", "1024", "--cp", "0"], "positive whole number"),
    (["--params", "70e9", "--gpus", "1024", "--cp", "2", "--cp-variant", "zigzag"], "invalid choice"),
    (["--params", "70e9", "--gpus", "1024", "--tp", "8", "--pp", "8", "--cp", "64"],
     "tp x pp x cp = 4096 does not divide the 1024 GPUs"),
    (LLAMA + ["--cp", "8", "--cp-variant", "ulysses"], "Ulysses cp 8 does not divide"),
    (["--params", "7e9", "--gpus", "16", "--tp", "8", "--pp", "1", "--only", "--tp-comm-overlap"],
     "--tp-comm-overlap needs sequence parallelism"),
    (["--params", "7e9", "--gpus", "64", "--tp-comm-overlap", "--no-sequence-parallel"],
     "--tp-comm-overlap needs SP: drop --no-sequence-parallel"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as err:
        main(argv)
    out = capsys.readouterr()
    assert err.value.code == 2
    assert out.err.count("\n") == 1 and words in out.err, out.err


def test_json_lists_layouts_with_the_agreed_keys(capsys):
    code, out = run(capsys, ["--params", "70e9", "--gpus", "1024", "--gpu", "h100-sxm", "--json"])
    doc = json.loads(out.out)
    assert code == 0 and len(doc["layouts"]) == 5
    assert all(JSON_KEYS <= set(lay) for lay in doc["layouts"])
    assert all(lay["tp"] <= 8 and lay["fits"] for lay in doc["layouts"])


def test_fixed_llama3_layout_prints_that_one_layout(capsys):
    code, out = run(capsys, LLAMA + ["--only", "--json"])
    doc = json.loads(out.out)
    assert code == 0 and len(doc["layouts"]) == 1
    lay = doc["layouts"][0]
    assert (lay["tp"], lay["pp"], lay["dp"]) == (8, 16, 64)
    code, out = run(capsys, LLAMA + ["--only", "--explain"])
    lines = out.out.splitlines()
    assert code == 0 and max(map(len, lines)) <= 100
    assert any("MFU" in line for line in lines) and any("bubble" in line for line in lines)


def test_the_cli_states_the_published_llama3_row(capsys):
    """Every field of the layout plan.published models for Llama 3 405B on 8192 GPUs has a
    flag, --flash-attention included: the CLI prints that row's prediction."""
    from minidist.plan import published
    row = next(r for r in published.ROWS if r.label == "405B on 8192")
    code, out = run(capsys, LLAMA + ["--chunks", "8", "--zero", "2", "--accumulate", "16",
                                     "--sequence-parallel",
                                     "--flash-attention", "--only", "--json"])
    lay = json.loads(out.out)["layouts"][0]
    assert code == 0 and lay["mfu"] == published.predict(row)[0]


def test_text_output_fits_100_columns(capsys):
    code, out = run(capsys, ["--params", "70e9", "--gpus", "1024", "--explain"])
    assert code == 0 and max(map(len, out.out.splitlines())) <= 100


def test_published_rows_present_and_errors_come_from_predictions():
    result = compare()
    labels = [(r["source"][:11], r["label"]) for r in result["rows"]]
    assert sum(s == "Korthikanti" for s, _ in labels) == 8
    for size in ("1.7B", "18.4B", "145.6B", "1T"):
        assert any(s == "Narayanan e" and lab.startswith(size + " ") for s, lab in labels), size
    assert sum(s.startswith("Llama 3") for s, _ in labels) == 3
    for r in result["rows"]:
        assert r["rel_error"] == r["predicted"] / r["published"] - 1
    errs = [abs(r["rel_error"]) for r in result["rows"]]
    assert result["mean_abs_error"] == sum(errs) / len(errs) and result["worst_abs_error"] == max(errs)


def test_one_row_by_hand_narayanan_1t():
    """Narayanan et al.'s 1T row: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs over the step the
    model's parts add up to, per GPU, against 163 TFLOP/s."""
    row = next(r for r in ROWS if r.source.startswith("Narayanan") and r.label.startswith("1T"))
    B, s, L, h, V, n = 3072, 2048, 128, 25600, 51200, 3072
    e = estimate(row.model, make_cluster("a100-80gb", n), row.layout)
    step = e.compute_s + e.tp_s + e.bubble_s + e.pp_s + e.dp_s + e.optimizer_s
    by_hand = 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h)) / step / n / 1e12
    assert flops.step_flops(B, s, L, h, V, recompute="full")[1] == pytest.approx(by_hand * step * n * 1e12)
    got = next(r for r in compare()["rows"] if r["label"] == row.label and r["source"] == row.source)
    assert got["rel_error"] == pytest.approx(by_hand / 163 - 1, rel=1e-9)


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm"])
def test_efficiency_constant_minimises_the_worst_error_of_its_rows(monkeypatch, gpu):
    """cluster.py's rule: each GPU type's one constant is the value, to 0.01, whose worst
    relative error over that type's published rows is least, then the next worst (the
    |errors| sorted from the worst, to 1e-6: rows the constant cannot move share a worst);
    0.01 either way is worse."""
    import minidist.plan.cluster as cluster
    base = cluster.GPUS[gpu]
    rows = [r for r in ROWS if r.gpu == gpu]

    def worst(eff):
        monkeypatch.setitem(cluster.GPUS, gpu, cluster.with_efficiency(base, eff))
        return sorted((round(abs(r["rel_error"]), 6) for r in compare(rows)["rows"]), reverse=True)

    chosen = worst(base.matmul_efficiency)
    assert worst(base.matmul_efficiency - 0.01) > chosen < worst(base.matmul_efficiency + 0.01)


def test_published_table_fits_100_columns():
    from minidist.plan.published import table
    lines = table(compare())
    assert len(lines) == len(ROWS) + 2 and max(map(len, lines)) <= 100


# ----------------------------------------------------------------------------- context parallelism

SMALL = Model(4, 256, 8, 1000, 1024, 16, kv_heads=4)


def small(cp, variant="allgather", tp=2, pp=2, dp=2, gpus_per_node=8, **kw):
    lay = Layout(tp, pp, dp, 1, zero=1, sequence_parallel=True, flash_attention=True, cp=cp,
                 cp_variant=variant, **kw)
    return estimate(SMALL, make_cluster("h100-sxm", tp * pp * dp * cp, gpus_per_node), lay)


@pytest.mark.parametrize("layout, words", [
    (Layout(2, 2, 2, 1, cp=3), "tp x pp x dp x cp = 2 x 2 x 2 x 3 = 24, not the 16 GPUs"),
    (Layout(2, 2, 1, 1, cp=4), "2 x cp = 8 equal chunks"),
    (Layout(2, 2, 2, 1, cp=2, cp_variant="ulysses"), "Ulysses cp 2 does not divide"),
    (Layout(2, 2, 2, 1, cp=2, cp_variant="pass-q"), "must be one of ring, ulysses, allgather"),
])
def test_cp_rules(layout, words):
    model = Model(4, 256, 8, 1000, 1020 if "chunks" in words else 1024, 16, kv_heads=2)
    why = legal(model, make_cluster("h100-sxm", 16), layout)
    assert why is not None and words in why, why
    assert legal(model, make_cluster("h100-sxm", 16), Layout(2, 2, 2, 1, cp=2)) is None


@pytest.mark.parametrize("variant", ["ring", "ulysses", "allgather"])
def test_cp_bytes_are_plan_context_per_layer_times_layers_and_micro_batches(variant):
    """The CP group's bytes per step: plan.context.cp_layer_bytes of a TP rank's heads
    (8/2 heads, 4/2 KV heads) x the stage's layers x the micro-batches, in 2-byte values."""
    from minidist.plan.context import cp_layer_bytes
    e = small(2, variant)
    m = SMALL.global_batch // 2
    per = cp_layer_bytes(variant, 1, 1024, 4, 32, 2, 2, 2)
    assert e.bytes_sent["cp"] == 2 * m * per
    assert "cp" not in small(1).bytes_sent                  # no CP group, no "cp" key


def test_memory_and_compute_per_gpu_fall_with_cp():
    """Each GPU keeps s/cp tokens: with flash attention every per-token term is 1/cp (the
    activations, the logits, the compute: causal attention balanced, 1/cp of the s x s
    work each), and ZeRO-1 shards the optimizer state over dp x cp."""
    one = small(1)
    for cp in (2, 4):
        e = small(cp)
        assert e.memory["activations"] == pytest.approx(one.memory["activations"] / cp, rel=1e-12)
        assert e.compute_s == pytest.approx(one.compute_s / cp, rel=1e-12)
        assert e.memory["optimizer"] == pytest.approx(one.memory["optimizer"] / cp, rel=1e-12)
        assert e.memory["weights"] == one.memory["weights"]
        assert e.memory_bytes_per_gpu < one.memory_bytes_per_gpu
        assert e.model_flops == one.model_flops              # the same step, on cp x the GPUs


def test_ring_hides_behind_attention_and_the_cp_group_lands_by_tp_x_cp():
    """The ring's exchange overlaps the layer's attention (this project's choice): never
    more exposed than the all-gather's, which is exposed whole. TP 2 x CP 4 fits a node of
    8; with nodes of 4 the CP group crosses them and costs more."""
    ring, gather = small(4, "ring"), small(4, "allgather")
    assert ring.bytes_sent["cp"] == gather.bytes_sent["cp"]
    assert 0 <= ring.cp_s <= gather.cp_s and gather.cp_s > 0
    assert small(4, gpus_per_node=4).cp_s > gather.cp_s


def test_ring_latency_is_three_steps_per_layer_and_its_window_causal_attention():
    """The ring's calls are the engine's ring steps, 3 (cp-1) per layer and micro-batch
    (K, V forward; K, V and dK, dV backward), each one send (one latency); the window it
    hides behind is the causal kernel's work, plan.context.attention_scores (s (s+1)/2 per
    head, 1/cp on each balanced rank), 3 x its forward FLOPs at the stage's matmul rate."""
    from minidist.plan import step_bytes
    from minidist.plan.context import attention_scores
    cp, m = 4, SMALL.global_batch // 2
    ring = small(cp, "ring")
    row = step_bytes.rank_sent(SMALL, ring.layout, stage_layers(SMALL.layers, 2)[0])["cp"]
    assert row["send"][0] == 2 * m * 3 * (cp - 1)            # 2 layers per stage
    g = GPUS["h100-sxm"]
    rate = 2 * g.peak_flops * g.matmul_efficiency
    hd = SMALL.hidden // SMALL.heads
    for r in range(cp):                                       # every balanced rank the same
        causal = 4 * hd * attention_scores("ring", 1, SMALL.seq, SMALL.heads, cp, r)
        window = next(v for q, _, v in ring.lines if q == "causal attention per layer")
        assert window == pytest.approx(3 * causal / rate, rel=1e-12)
    whole = flops.attention_score_flops(1, SMALL.seq, SMALL.hidden) / cp
    assert window == pytest.approx(3 * whole / rate * (SMALL.seq + 1) / (2 * SMALL.seq), rel=1e-12)


def test_allgather_is_exposed_but_small_at_128k():
    """Llama 3 (section 3.3.2): the all-gather of K, V is exposed but small next to
    attention; the 128K row's exposed CP is a few percent of its step."""
    row = next(r for r in compare()["rows"] if r["label"] == "405B 128K on 16384")
    split = row["split"]
    step = sum(v for k, v in split.items() if k != "elementwise_s")
    assert 0 < split["cp_s"] < 0.05 * step and split["cp_s"] < 0.1 * split["compute_s"]


def test_llama3_128k_row():
    """Llama 3's 128K stage (Table 4): 16,384 H100s at TP 8, CP 16, PP 16, DP 8 (the GPU
    count needs DP 8), all-gather CP, 128 sequences of 131,072 (16M tokens), 38% MFU."""
    from minidist.plan import published
    row = next(r for r in ROWS if r.label == "405B 128K on 16384")
    lay = row.layout
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.cp_variant) == (8, 16, 16, 8, "allgather")
    assert lay.gpus == row.gpus == 16384 and row.model.seq == 131072
    assert row.model.global_batch * row.model.seq == 128 * 131072 and row.published == 0.38
    value, est = published.predict(row)
    assert est.bytes_sent["cp"] > 0 and est.cp_s > 0 and value == est.mfu


def test_cli_cp_prints_one_layout(capsys):
    argv = LLAMA[:1] + ["16384"] + LLAMA[2:] + ["--cp", "16", "--seq", "131072", "--global-batch",
                                                "128", "--chunks", "8", "--zero", "2",
                                                "--accumulate", "16",
                                                "--sequence-parallel", "--flash-attention", "--only"]
    code, out = run(capsys, argv + ["--json"])
    doc = json.loads(out.out)
    assert code == 0 and len(doc["layouts"]) == 1
    lay = doc["layouts"][0]
    assert (lay["tp"], lay["cp"], lay["pp"], lay["dp"], lay["cp_variant"]) == (8, 16, 16, 8, "allgather")
    from minidist.plan import published
    row = next(r for r in published.ROWS if r.label == "405B 128K on 16384")
    assert lay["mfu"] == published.predict(row)[0]
    code, out = run(capsys, argv + ["--explain"])
    lines = out.out.splitlines()
    assert code == 0 and max(map(len, lines)) <= 100 and any("exposed CP" in line for line in lines)


def test_activation_count_follows_model_shape():
    """GPT-shaped models keep Korthikanti's count in the estimate (the published GPT rows do
    not move); a Llama shape (SwiGLU, GQA, no dropout) is counted by its own tensors,
    plan.memory.layer_activation_bytes, below GPT's 34sbh/t for 405B."""
    from minidist.plan.memory import layer_activation_bytes
    gpt = Model(48, 6144, 64, 51200, 2048, 4)
    lay = Layout(8, 1, 1, 1, sequence_parallel=True, recompute="selective", precision="zero")
    est = estimate(gpt, make_cluster("a100-80gb", 8), lay)
    assert est.memory["activations"] == 48 * activation_layer_bytes(2048, 1, 6144, 64, 8, True, "selective")
    llama = Model(16, 16384, 128, 128256, 8192, 8, ffn_hidden=53248, kv_heads=8, swiglu=True)
    lay = Layout(8, 1, 1, 1, sequence_parallel=True, precision="megatron", flash_attention=True)
    est = estimate(llama, make_cluster("h100-sxm", 8), lay)
    per = layer_activation_bytes(8192, 1, 16384, 128, 8, True, ffn=53248, kv_heads=8, swiglu=True,
                                 dropout=False, flash_attention=True)
    assert est.memory["activations"] == pytest.approx(16 * per, rel=1e-12)
    assert per < activation_layer_bytes(8192, 1, 16384, 128, 8, True, attention="blockwise")


# -- the terms of real runs: GEMM shapes, link efficiency, contention, TP overlap


def test_gemm_waves_tiles_and_bytes():
    """plan.gemm: 108 tiles of 256 x 128 fill one A100 wave (factor 1), one column more
    takes a second wave; a one-wave GEMM with K = 64 is bound by HBM: intensity x bandwidth
    / rate."""
    from minidist.plan.cluster import GPUS
    from minidist.plan.gemm import shape_factor
    a100 = GPUS["a100-80gb"]
    assert shape_factor(256 * 12, 128 * 9, 8192, a100) == 1.0
    assert shape_factor(256 * 12, 128 * 9 + 128, 8192, a100) == pytest.approx(120 / 216)
    m, n, k = 256, 128 * 108, 64
    intensity = 2 * m * n * k / (2 * (m * k + k * n + m * n))
    rate = a100.peak_flops * a100.matmul_efficiency
    assert shape_factor(m, n, k, a100) == pytest.approx(intensity * a100.hbm_bytes_per_s / rate)
    assert shape_factor(m, n, k, a100) < 0.6


def test_gemm_shapes_off_times_the_flop_count():
    """Without GEMM shapes a layer's products take its FLOPs at t x peak x efficiency
    (the count of plan.flops); with them, no less."""
    model = Model(4, 1024, 8, 51200, 2048, 64)
    lay = Layout(2, 1, 4, 1)
    off, on = (estimate(model, make_cluster("h100-sxm", 8, gemm_shapes=s), lay) for s in (False, True))
    g = GPUS["h100-sxm"]
    layer = 3 * flops.layer_flops(1, 2048, 1024, heads=8) / (2 * g.peak_flops * g.matmul_efficiency)
    line = dict((q, v) for q, _, v in off.lines)["layer matmuls / micro-batch"]
    assert line == pytest.approx(layer, rel=1e-12)
    assert on.compute_s > off.compute_s


def test_links_contention_and_efficiency():
    """Cluster.link: one GPU per node in a group gets its own NIC; a group of 8 per node the
    node's 8 NICs, never more than NVLink; a measured machine (contention off) one NIC;
    link_efficiency multiplies by Calculon's 0.6 (NVLink) and 0.9 (network)."""
    from minidist.plan.cluster import ranks_per_node
    c = make_cluster("a100-80gb", 64)
    assert c.link(64, ranks_per_node(8, 8, 8)) == (c.inter_alpha, 25e9)
    assert c.link(64, ranks_per_node(1, 64, 8)) == (c.inter_alpha, 200e9)
    assert c.link(64, 8, crossing=16) == (c.inter_alpha, 100e9)        # two phases at once
    assert make_cluster("a100-80gb", 64, contention=False).link(64, 8)[1] == 25e9
    e = make_cluster("a100-80gb", 64, link_efficiency=True)
    assert e.link(8)[1] == pytest.approx(0.6 * 300e9) and e.link(64)[1] == pytest.approx(0.9 * 25e9)
    assert e.link(64, 8)[1] == pytest.approx(0.6 * 300e9)                # the NVLink hops bound it


def test_tp_comm_overlap():
    """--tp-comm-overlap needs SP; with it each layer's TP messages c hide behind its GEMMs g,
    which lose u of the GPU meanwhile: max(c - g, u c) of c shows (cost.py)."""
    from minidist.plan.cost import TP_OVERLAP_SM_SHARE as u
    from minidist.plan import step_bytes as SB
    from minidist.plan.traffic import tp_sent
    model = Model(4, 8192, 64, 51200, 2048, 8)
    cluster = make_cluster("h100-sxm", 8)
    assert "sequence parallelism" in legal(model, cluster, Layout(8, 1, 1, 1, tp_comm_overlap=True))
    off, on = (estimate(model, cluster, Layout(8, 1, 1, 1, sequence_parallel=True, tp_comm_overlap=o))
               for o in (False, True))
    one = tp_sent(1, 2048, 8192, 1, 8, 0, 2, 1, False, False, True, True, 0, False, 0)
    c = SB.seconds({k: v for k, v in one.items() if v[1]}, 8, *cluster.link(8))
    assert c < off.compute_s / 32 / 2                     # compute-bound: u c shows of each c
    assert on.tp_s == pytest.approx(off.tp_s - 8 * 4 * (1 - u) * c, rel=1e-9)
    assert on.compute_s == off.compute_s


def test_tp_comm_overlap_searched_where_sp_and_held_when_given():
    """The search tries --tp-comm-overlap on and off where SP is on, never without SP; a
    value the user gives is held."""
    model, cluster = Model(4, 1024, 8, 51200, 2048, 16), make_cluster("h100-sxm", 8)
    seen = {(lay.sequence_parallel, lay.tp_comm_overlap) for lay in layouts(model, cluster)}
    assert seen == {(False, False), (True, False), (True, True)}
    held = {lay.tp_comm_overlap for lay in layouts(model, cluster, tp_comm_overlap=False)}
    assert held == {False}
