"""Published training runs, and the planner's predictions of them.

    python -c "from minidist.plan.published import evaluate, table; print(*table(evaluate()), sep='\\n')"

Each row is compared in the unit its paper reports, like with like:
  step_s            seconds per iteration (Korthikanti et al. 2022, arXiv 2205.05198,
                    Table 5, column "Iteration time (s)", full recomputation and "present
                    work" = sequence parallelism + selective recomputation); model shapes,
                    TP, PP and batch from their Table 3; A100 80GB, V = 51200, s = 2048, DP 1
  tflops_hardware   TFLOP/s per GPU counting the recomputed forward, Narayanan et al.'s
                    96BsLh^2(1 + s/6h + V/16Lh) (Narayanan et al. 2021, arXiv 2104.04473,
                    Table 1, column "Achieved teraFLOP/s per GPU"; all rows use full
                    activation recomputation, section 5.1; A100 80GB on Selene)
  mfu               model FLOPs utilisation (Grattafiori et al. 2024, arXiv 2407.21783, Llama 3,
                    Table 4, column "BF16 MFU"; H100 SXM, 8,192 and 16,384 GPUs at 8K tokens,
                    and the 128K stage with context parallelism 16 on 16,384 GPUs, 38%)
  step_s            also Smith et al. 2022 (MT-NLG 530B, section 2.4: 60.1, 50.2, 44.4 s per
                    iteration on 280, 350, 420 DGX A100s, batch 1920, TP 8 x PP 35; quoted by
                    cli99/llm-analysis, the paper's text not in the stored corpus) and BLOOM's
                    training log (bigscience-workshop/bigscience train/tr11-176B-ml: the slurm
                    script's layout, chronicles.md's "elapsed time per iteration (s): 105.22")
  tokens_s          tokens per second per GPU, no FLOP convention (MosaicML llm-foundry,
                    scripts/train/benchmarking/README.md, "Throughput (T/s/GPU)", tables H100
                    80GB BF16 and A100 80GB: the rows at sequence 2048 of the 7B-70B models)
  tflops_model      TFLOP/s per GPU of model FLOPs, the active experts' only (Megatron-LM's
                    --log-throughput, num_floating_point_operations: top-k experts, no router,
                    no recomputation): the one mixture of experts, Mixtral 8x22B on 128 H100s
                    with MoE Parallel Folding (expert TP 1 beside TP 2; Liu et al. 2025,
                    arXiv 2504.14960), as the Megatron MoE Model Zoo runs it (github
                    yanring/Megatron-MoE-ModelZoo, whose best_practice/readme.md ties it to
                    NVIDIA's Megatron Core MoE report, arXiv 2603.07685;
                    best_practice/Mixtral/run_mixtral_8x22B.sh's
                    "around 455 TFLOPS" dropless and "around 470" with capacity factor 1.0,
                    padded; the layout from runtime_configs/benchmarking/runtime.conf and
                    model_configs/benchmarking/Mixtral-8x22B.yaml), a row with a MoE layout
                    (Row.experts, ep, etp) predicted by plan.experts.estimate_moe
Details the tables do not give are said in each row's note: micro-batch size and
interleaving for Korthikanti's rows are those of Calculon's validation inputs (Isaev et
al. 2023, calculon-ai/calculon validation/*.json), which we could not confirm in the paper
itself; Narayanan's Table 1 gives neither, and Llama 3 gives neither at these rows.
Llama 3's 128K row: Table 4 prints DP 4 and 16 sequences per DP rank, which is
inconsistent with its own 16,384 GPUs (TP 8 x CP 16 x PP 16 x DP 4 = 8,192) and with its
16M tokens per batch (DP 4 x 16 x 131,072 = 8.4M). DP 8 is the value consistent with both
(8 x 16 x 16 x 8 = 16,384 GPUs; 8 x 16 x 131,072 = 16.8M tokens, 128 sequences), and the
planner uses it: an inference from the table's other columns, not a printed figure.

Fitting and holding out. The efficiency constants of cluster.py are one number per GPU
type, chosen once by one rule over that type's rows (fit(): the value, to 0.01, whose worst
error is least, then the next worst): one parameter per GPU type, never one per row;
fit_constants() recomputes them. leave_one_source_out() asks what that costs on a run the
constants never saw: each source's rows are predicted with the constants the same rule picks
from the rows of every OTHER source, so that neither a row's own figure nor its paper's
habits (its FLOP convention, its cluster, its software) enter its prediction. A source whose
GPU type no other source has (none today) is predicted from the other types' rows (an
efficiency is a fraction of each GPU's own peak), and says so ("fit_on"); a table of one
source alone cannot be held out and says that. evaluate() puts both errors on every row.
"""
from dataclasses import dataclass

from minidist.plan.cluster import GPUS, make_cluster, with_efficiency
from minidist.plan.cost import estimate
from minidist.plan.experts import Experts, estimate_moe
from minidist.plan.layout import Layout, Model
from minidist.plan.memory import LLAMA3_FSDP_ZERO

A100, H100 = "a100-80gb", "h100-sxm"
K_SRC = "Korthikanti et al. 2022, Table 5"
N_SRC = "Narayanan et al. 2021, Table 1"
L_SRC = "Llama 3 (Grattafiori et al. 2024), Table 4"
S_SRC = "Smith et al. 2022 (MT-NLG 530B), sec. 2.4"
B_SRC = "BLOOM 176B training log (BigScience)"
M_SRC = "MosaicML llm-foundry benchmarks"
X_SRC = "Megatron MoE Model Zoo (NVIDIA)"
S_NOTE = ("the paper's figures as quoted by cli99/llm-analysis examples/megatron-turing-nlg (README: "
          "batch 1920 on 280, 350, 420 DGX A100s, 60.1, 50.2, 44.4 s per iteration, 126, 121, 113 "
          "TFLOP/s per GPU; run_train.sh: TP 8, PP 35) and, for the 280-node figures, by a reader "
          "quoting NVIDIA's blog (LessWrong): the paper's own text is not in the stored corpus; vocabulary 50,272 from "
          "llm-analysis's config; micro-batch 1, no interleaving, full recomputation and Narayanan's "
          "accounting assumed (not given); the GPUs are A100s (40 GB per llm-analysis, 80 GB per "
          "Microsoft's blog): the planner's A100 80GB, so only the memory column depends on which")
B_NOTE = ("bigscience-workshop/bigscience train/tr11-176B-ml: tr11-176B-ml.slurm (48 nodes of 8 "
          "A100 80GB, TP 4, PP 12, so DP 8; micro-batch 2, global batch 2048, L 70, h 14336, 112 "
          "heads, s 2048, vocabulary padded to 250,880, --checkpoint-activations, bf16 with "
          "DeepSpeed's BF16 optimizer, 'its own zero stage 1 equivalent', fp32 gradient "
          "accumulation) and chronicles.md, 2022-03-18: 'elapsed time per iteration (s): 105.22' "
          "at global batch 2048 (its TFLOP/s: 149.02); pipeline stages from "
          "--pp-partition-method 'type:transformer|embedding', 70 layers + 2 embeddings over 12 "
          "stages, the planner's Llama-3-style split (5, 6 x 10, 5); network: 4 Omni-Path 100 Gb/s "
          "links per node (BLOOM paper, as summarised for Jean Zay), 6.25 GB/s per GPU")
M_NOTE = ("scripts/train/benchmarking/README.md, tables 'H100 80GB BF16' and 'A100 80GB with 1600 "
          "Gbps node-node interconnect (RoCE)', column 'Throughput (T/s/GPU)' (tokens per second per "
          "GPU: no FLOP convention); the rows at sequence 2048 of the models of 7B and more (the "
          "smaller ones would need the GEMM-shape term, plan.gemm, off by default); shapes from "
          "scripts/train/yamls/pretrain/mpt-{7b,13b,30b,70b}.yaml (d_model, n_heads, n_layers, "
          "expansion ratio 4, vocabulary 50,368), matching the table's NumParams; FSDP FULL_SHARD "
          "modelled as ZeRO-3 over all the GPUs, with the table's micro-batch, gradient "
          "accumulation and activation checkpointing (as full recomputation); flash attention; "
          "ALiBi and tied embeddings not modelled; the H100 table does not state its network: "
          "DGX H100's 50 GB/s per GPU assumed; A100's 1600 Gb/s per node is 25 GB/s per GPU")
X_NOTE = ("github yanring/Megatron-MoE-ModelZoo, Megatron-Core MoE benchmarking scripts (its "
          "best_practice/readme.md: the reproduction scripts of NVIDIA's Megatron Core MoE report): "
          "best_practice/Mixtral/run_mixtral_8x22B.sh, 'Dropless training, stable performance should be "
          "around 455TFLOPS for H100' and 'Token Drop training, perf should be around 470TFLOPS' "
          "(--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity): rounded figures in a "
          "script's comments, not a table; runtime.conf: TP 2, PP 8, EP 8, CP 1, VPP 1, micro-batch 1, "
          "global batch 256, 56 layers, 16 nodes, sequence 4096, alltoall dispatcher, grouped GEMM; "
          "Mixtral-8x22B.yaml: --expert-tensor-parallel-size 1 (MoE Parallel Folding, plan.experts' etp), "
          "h 6144, 48 heads, 8 query groups, SwiGLU f 16384, 8 experts top 2, bf16, sequence parallelism, "
          "flash attention, distributed optimizer (ZeRO 1) with --overlap-grad-reduce and "
          "--overlap-param-gather, --tp-comm-overlap, no recomputation; Llama2Tokenizer: vocabulary 32,000 "
          "(the README's '32K'); DGX H100 network (the Megatron MoE README's benchmarks: 8 x 400 Gbit/s "
          "InfiniBand per node) assumed. Megatron's TFLOP/s count the model FLOPs of the top-2 experts "
          "(megatron/training/training.py, num_floating_point_operations); its newer versions count half "
          "the s x s attention (causal), older ones all of it, as the planner does: 3.4% of this model's "
          "FLOPs, which version ran is not said. Even routing: the planner predicts the same for both "
          "rows (dropless imbalance, which the 15 TFLOP/s between them reflects, is not modelled)")
K_NOTE = "micro-batch and interleaving from Calculon's inputs, not confirmed in the paper"
N_NOTE = ("micro-batch 1 and no interleaving assumed: Table 1 gives neither; also today's Megatron "
          "assumed: 2-byte gradients, their reduction overlapped with the last backward")
L_NOTE = ("micro-batch 1, 8 chunks per rank (one layer each), SP and flash attention assumed; DP is "
          "FSDP as section 3.3.2 describes it, plan.memory.LLAMA3_FSDP_ZERO: weights kept after forward, "
          "fp32 gradients and optimizer state sharded (ZeRO 2), each chunk's gradient accumulated in fp32 "
          "over the schedule's N contiguous micro-batches (N = PP = 16 assumed: the paper does not give "
          "it) and reduce-scattered once per N; activations by the model's shape (plan.memory); "
          "attention FLOPs counted for the whole s x s (Meta does not say)")
L128_NOTE = ("the 128K stage: the 8K rows' assumptions, plus CP 16 as Llama 3's all-gather of K and V "
             "(their section 3.3.2: exposed but small next to attention; modelled exposed) over 16 nodes; "
             "Table 4 prints DP 4, inconsistent with its own 16,384 GPUs (8 x 16 x 16 x 4 = 8,192) and 16M "
             "tokens (4 x 16 x 131,072 = 8.4M): DP 8, consistent with both, used (128 sequences); the "
             "attention's s x s products, 57% of this row's FLOPs, are timed at the GEMMs' efficiency, "
             "where FlashAttention-2 reaches about 35% of an H100's peak (Shah et al. 2024, "
             "FlashAttention-3): the planner does not model that, and leans optimistic here")


@dataclass(frozen=True)
class Row:
    source: str
    label: str
    model: Model
    gpu: str
    gpus: int
    layout: Layout
    published: float
    kind: str               # "step_s" | "mfu" | "tflops_hardware" | "tflops_model" | "tokens_s"
    note: str = ""
    inter_bw: float = None  # the cluster's network, bytes/s per GPU, where the source gives it
    experts: Experts = None  # a mixture of experts: predicted by plan.experts.estimate_moe
    ep: int = 1             # its expert parallelism
    etp: int = None         # its expert TP (None: the layout's TP, coupled)


def _gpt(L, h, a, B):
    return Model(L, h, a, 51200, 2048, B)


def _korthikanti():
    shapes = [("22B", 48, 6144, 64, 4, 1, 4, 1, 1.42, 1.10),
              ("175B", 96, 12288, 96, 64, 8, 1, 3, 18.13, 13.75),
              ("530B", 105, 20480, 128, 280, 35, 1, 3, 49.05, 37.83),
              ("1T", 128, 25600, 160, 512, 64, 1, 1, 94.42, 71.49)]
    rows = []
    for name, L, h, a, B, p, b, v, full, sel in shapes:
        for how, rc, sp, value in (("full recompute", "full", False, full),
                                   ("SP + selective", "selective", True, sel)):
            lay = Layout(8, p, 1, b, chunks=v, sequence_parallel=sp, recompute=rc, precision="zero")
            rows.append(Row(K_SRC, f"{name} {how}", _gpt(L, h, a, B), A100, 8 * p, lay, value,
                            "step_s", K_NOTE))
    return rows


def _narayanan():
    table = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 30, 3072, 32, 2, 1, 64, 512, 138),
             ("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142), ("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135),
             ("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138),
             ("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140),
             ("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148),
             ("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155),
             ("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163),
             ("1T", 128, 25600, 160, 8, 64, 3072, 3072, 163)]
    return [Row(N_SRC, f"{name} on {n}", _gpt(L, h, a, B), A100, n,
                Layout(t, p, n // (t * p), 1, recompute="full", precision="zero"), tf,
                "tflops_hardware", N_NOTE)
            for name, L, h, a, t, p, n, B, tf in table]


def _llama3():
    shape = Model(126, 16384, 128, 128256, 8192, 2048, ffn_hidden=53248, kv_heads=8, swiglu=True)
    rows = [Row(L_SRC, f"405B on {n}", shape, H100, n,
                Layout(8, 16, n // 128, 1, chunks=8, zero=LLAMA3_FSDP_ZERO, sequence_parallel=True,
                       precision="megatron", flash_attention=True, accumulate=16), mfu, "mfu", L_NOTE)
            for n, mfu in ((8192, 0.43), (16384, 0.41))]
    long = Model(126, 16384, 128, 128256, 131072, 128, ffn_hidden=53248, kv_heads=8, swiglu=True)
    rows.append(Row(L_SRC, "405B 128K on 16384", long, H100, 16384,
                    Layout(8, 16, 8, 1, chunks=8, zero=LLAMA3_FSDP_ZERO, sequence_parallel=True,
                           precision="megatron", flash_attention=True, cp=16, cp_variant="allgather",
                           accumulate=16), 0.38, "mfu", L128_NOTE))
    return rows


def _mtnlg():
    shape = Model(105, 20480, 128, 50272, 2048, 1920)
    return [Row(S_SRC, f"530B on {8 * nodes}", shape, A100, 8 * nodes,
                Layout(8, 35, 8 * nodes // 280, 1, recompute="full", precision="zero"), step, "step_s",
                S_NOTE)
            for nodes, step in ((280, 60.1), (350, 50.2), (420, 44.4))]


def _bloom():
    shape = Model(70, 14336, 112, 250880, 2048, 2048)
    lay = Layout(4, 12, 8, 2, zero=1, recompute="full", precision="megatron")
    return [Row(B_SRC, "176B on 384", shape, A100, 384, lay, 105.22, "step_s", B_NOTE, inter_bw=6.25e9)]


def _mosaic():
    shapes = {"7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
    table = [   # gpu, model, GPUs, micro-batch, grad. accum., activation checkpointing, tokens/s/GPU
        (H100, "70b", 64, 8, 4, True, 1039), (H100, "70b", 32, 2, 16, True, 882),
        (H100, "30b", 32, 14, 3, True, 2308), (H100, "30b", 16, 10, 3, True, 2263),
        (H100, "30b", 8, 3, 21, True, 2002), (H100, "13b", 64, 2, 1, False, 4800),
        (H100, "13b", 32, 2, 1, False, 4811), (H100, "13b", 16, 2, 1, False, 4767),
        (H100, "13b", 8, 2, 1, False, 4792), (H100, "7b", 8, 6, 1, False, 10643),
        (A100, "70b", 64, 8, 4, True, 410), (A100, "70b", 32, 2, 16, True, 373),
        (A100, "30b", 8, 3, 21, True, 916), (A100, "13b", 8, 2, 3, False, 2262),
        (A100, "7b", 8, 6, 2, False, 4641)]
    rows = []
    for gpu, name, n, b, ga, ac, tokens in table:
        L, h, a = shapes[name]
        lay = Layout(1, 1, n, b, zero=3, recompute="full" if ac else "none", precision="zero",
                     flash_attention=True)
        rows.append(Row(M_SRC, f"{name} on {n} {gpu[:4].upper()}", Model(L, h, a, 50368, 2048, n * b * ga),
                        gpu, n, lay, tokens, "tokens_s", M_NOTE))
    return rows


def _moe_zoo():
    shape = Model(56, 6144, 48, 32000, 4096, 256, ffn_hidden=16384, kv_heads=8, swiglu=True)
    lay = Layout(2, 8, 8, 1, zero=1, sequence_parallel=True, precision="megatron", flash_attention=True,
                 tp_comm_overlap=True)
    return [Row(X_SRC, label, shape, H100, 128, lay, tflops, "tflops_model", X_NOTE,
                experts=Experts(8, 2, capacity_factor=cf), ep=8, etp=1)
            for label, cf, tflops in (("8x22B dropless", None, 455), ("8x22B capacity 1", 1.0, 470))]


ROWS = _korthikanti() + _narayanan() + _llama3() + _mtnlg() + _bloom() + _mosaic() + _moe_zoo()


def predict(row, gpu=None):
    """The planner's figure for a row, in the row's unit (gpu: another GPU of its type, e.g.
    with another efficiency)."""
    cluster = make_cluster(row.gpu, row.gpus, gpu=gpu, inter_bw=row.inter_bw)
    if row.experts is not None:
        est = estimate_moe(row.model, row.experts, cluster, row.layout, row.ep, etp=row.etp)
    else:
        est = estimate(row.model, cluster, row.layout)
    if row.kind == "tokens_s":
        return row.model.global_batch * row.model.seq / est.step_time_s / row.gpus, est
    return getattr(est, {"step_s": "step_time_s", "mfu": "mfu", "tflops_hardware": "tflops_per_gpu_hardware",
                         "tflops_model": "tflops_per_gpu_model"}[row.kind]), est


def compare(rows=ROWS):
    """{"rows": [{source, label, kind, predicted, published, rel_error, note, split, cp, ...}],
    "mean_abs_error", "worst_abs_error"}; rel_error = predicted / published - 1."""
    out = []
    for row in rows:
        value, est = predict(row)
        dense = getattr(est, "dense", est)                  # a MoE row's dense equivalent
        split = {k: getattr(dense, k) for k in ("compute_s", "elementwise_s", "tp_s", "cp_s", "bubble_s",
                                             "pp_s", "dp_s", "optimizer_s")}
        if dense is not est:                                # what the experts add (may be < 0)
            split.update(all_to_all_s=est.all_to_all_s, expert_dp_s=est.expert_dp_s,
                         expert_tp_s=est.expert_tp_s)
        out.append({"source": row.source, "label": row.label, "kind": row.kind, "predicted": value,
                    "cp": row.layout.cp, "cp_variant": row.layout.cp_variant,
                    "published": row.published, "rel_error": value / row.published - 1,
                    "note": row.note, "split": split, "memory_bytes_per_gpu": est.memory_bytes_per_gpu,
                    "fits": est.fits})
    errs = [abs(r["rel_error"]) for r in out]
    return {"rows": out, "mean_abs_error": sum(errs) / len(errs), "worst_abs_error": max(errs)}


GRID = (0.40, 0.95)       # the efficiencies the rule tries, in steps of 0.01


def _grid(lo, hi):
    return [round(lo + 0.01 * i, 2) for i in range(round((hi - lo) / 0.01) + 1)]


def _errors(rows, grid):
    """{(row index, efficiency): relative error} with the row's GPU type at that efficiency."""
    return {(i, e): predict(row, with_efficiency(GPUS[row.gpu], e))[0] / row.published - 1
            for i, row in enumerate(rows) for e in grid}


def fit(err, grid, idx):
    """cluster.py's rule over the rows idx: the efficiency whose worst |error| is least; where
    several share that worst (rows the constant cannot move, e.g. a step the planner finds
    communication-bound), the one whose next-worst is least, and so on (the |errors| sorted
    from the worst, compared in order, to 1e-6); the lower efficiency on a full tie."""
    def key(e):
        return sorted((round(abs(err[j, e]), 6) for j in idx), reverse=True), e
    return min(grid, key=key)


def fit_constants(rows=ROWS, lo=GRID[0], hi=GRID[1]):
    """cluster.py's rule applied to every GPU type with rows: {gpu name: efficiency} (what
    cluster.py's constants must equal; rerun after any change to the cost model)."""
    grid = _grid(lo, hi)
    err = _errors(rows, grid)
    return {g: fit(err, grid, [j for j, r in enumerate(rows) if r.gpu == g])
            for g in sorted({r.gpu for r in rows})}


def leave_one_source_out(rows=ROWS, lo=GRID[0], hi=GRID[1]):
    """Each source's rows predicted with constants fitted, by cluster.py's rule, to the rows of
    every OTHER source: for a row of GPU type g, the efficiency that minimises the worst error
    over the other sources' rows of type g. Where no other source has a row of type g, the
    fit runs over the other sources' rows of every type (an efficiency is a fraction of each
    GPU's own peak, so another type's constant carries over scaled by peak): the row's
    "fit_on" says "other GPU types". Where no other source has any row, the row cannot be held
    out: "rel_error" None, left out of the mean. {"rows": [{source, label, gpu, efficiency,
    fit_on, rel_error}], "mean_abs_error", "worst_abs_error", "held": rows with an error}."""
    grid = _grid(lo, hi)
    err = _errors(rows, grid)
    out = []
    for i, row in enumerate(rows):
        others = [j for j, r in enumerate(rows) if r.source != row.source]
        same = [j for j in others if rows[j].gpu == row.gpu]
        idx, on = (same, row.gpu) if same else (others, "other GPU types")
        best = fit(err, grid, idx) if idx else None
        out.append({"source": row.source, "label": row.label, "gpu": row.gpu, "efficiency": best,
                    "fit_on": on if idx else "cannot be held out",
                    "rel_error": None if best is None else err[i, best]})
    errs = [abs(r["rel_error"]) for r in out if r["rel_error"] is not None]
    return {"rows": out, "mean_abs_error": sum(errs) / len(errs) if errs else None,
            "worst_abs_error": max(errs) if errs else None, "held": len(errs)}


def evaluate(rows=ROWS):
    """compare() with, on each row, its leave-one-source-out error and efficiency
    ("loso_error", "loso_efficiency", "loso_fit_on"), and the out-of-sample mean and worst
    ("loso_mean_abs_error", "loso_worst_abs_error")."""
    result = compare(rows)
    loso = leave_one_source_out(rows)
    for r, h in zip(result["rows"], loso["rows"]):
        r.update(loso_error=h["rel_error"], loso_efficiency=h["efficiency"], loso_fit_on=h["fit_on"])
    result.update(loso_mean_abs_error=loso["mean_abs_error"], loso_worst_abs_error=loso["worst_abs_error"],
                  sources=len({row.source for row in rows}))
    return result


UNITS = {"step_s": ("s", 1), "mfu": ("%", 100), "tflops_hardware": ("TF/s", 1), "tflops_model": ("TF/s", 1),
         "tokens_s": ("tk/s", 1)}


def table(result):
    """The comparison as lines of at most 100 columns; with evaluate()'s result, a last column
    of the leave-one-source-out error ("held out")."""
    loso = "loso_mean_abs_error" in result
    lines = [f"{'source':<34}{'row':<17}{'predicted':>13}{'published':>13}{'error':>8}"
             + (f"{'held out':>10}" if loso else "")]
    for r in result["rows"]:
        unit, k = UNITS[r["kind"]]
        held = r.get("loso_error")
        lines.append(f"{r['source'][:33]:<34}{r['label']:<17}{r['predicted'] * k:>8.4g} {unit:<4}"
                     f"{r['published'] * k:>8.4g} {unit:<4}{100 * r['rel_error']:>+7.1f}%"
                     + (("" if held is None else f"{100 * held:>+9.1f}%") if loso else ""))
    if loso:
        lines.append(f"held out (leave-one-source-out): mean |error| {100 * result['loso_mean_abs_error']:.1f}%, "
                     f"worst {100 * result['loso_worst_abs_error']:.1f}%")
    lines.append(f"in sample: mean |error| {100 * result['mean_abs_error']:.1f}%, "
                 f"worst {100 * result['worst_abs_error']:.1f}% over {len(result['rows'])} rows")
    return lines
