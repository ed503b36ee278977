"""One layout of one model on one cluster: memory per GPU, FLOPs, communication, step time.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm --tp 8 --pp 8 --explain

Every formula comes from the modules above this one (plan.flops, plan.memory,
plan.pipeline, plan.step_bytes over plan.traffic, plan.collectives); this module adds
only how the parts add up to a step, which is this project's model of a Megatron-style run:

  step = compute + exposed TP + exposed CP + bubble + exposed PP + exposed DP + optimizer step
  compute  m micro-batches on the busiest stage: its matrix products' hardware FLOPs at
           peak x matmul_efficiency (cluster.py), each layer GEMM and the logits' at its own
           shape on one TP rank (plan.gemm: b s/cp tokens x h x h/t ..., forward and both
           gradients; with Cluster.gemm_shapes, each at its tiles' and waves' efficiency,
           else at the rate alone), the attention scores at the rate; plus its elementwise
           kernels (layer
           norms, softmax, dropout, GELU, residual adds), which are bound by HBM: each
           pass over a layer reads and writes about what the layer saves for backward
           (Korthikanti et al.'s count, plan.memory), so 2 x those bytes / HBM bandwidth
           per forward, twice that per backward, once more for a recomputed forward.
           This elementwise term is this project's own estimate; it is what makes small
           hidden sizes slower per FLOP with one efficiency constant.
Communication is timed from the bytes the busiest stage's first GPU sends, counted as this
engine sends them (plan.step_bytes: Estimate.bytes_sent, equal to the lessons' counters,
tests/mpi/test_plan_bytes.py): each collective call costs its message steps x alpha (a
ring all-reduce 2(N-1), reduce-scatter and all-gather N-1, a send 1) plus its bytes over
the link's bandwidth: the ring alpha-beta times of plan.collectives.
  CP       context parallelism (Layout.cp > 1) cuts each sequence over cp ranks, each
           holding 2 of the 2 cp load-balanced chunks: n = s/cp tokens per GPU, so every
           per-token count here (FLOPs, activations, TP and PP messages) takes n for s,
           and with the causal mask balanced every rank's attention does 1/cp of the
           s x s work (plan.flops' whole-s x s count, divided by cp). Per layer and
           micro-batch the attention exchange, plan.context.cp_layer_bytes of a TP rank's
           heads (plan.step_bytes), on the link of the tp x cp ranks a CP group spans
           (inside a node when tp x cp <= 8). Its latency: each call's message steps x
           alpha, the ring's 3 (cp-1) steps per layer (forward K, V; backward K, V and
           dK, dV: the engine's ring steps, one message latency each, K and V fused
           into one message as Transformer Engine sends them; plan.step_bytes).
           Exposed: the ring's K/V exchange overlaps that layer's attention compute
           (forward and backward), as Megatron-LM/Transformer Engine's p2p CP does, so
           only what exceeds it shows. The window it hides behind is the causal
           kernel's work, s (s+1)/2 scores per head, 1/cp of them on each balanced rank
           (plan.context.attention_scores), 3 x its forward FLOPs at the matmul rate:
           about half of what the compute term charges for attention, which keeps the
           whole s x s count (Narayanan et al.'s and, we assume, Meta's convention for
           FLOPs, standing in also for attention kernels slower than the GEMMs). So
           the window is the conservative one: the ring shows exposed sooner than the
           compute term alone would say. All-gather: Llama 3 (section 3.3.2) says its
           all-gather's latency is exposed on the critical path but small, K and V
           being small under GQA and the attention O(S^2) against the gather's O(S):
           modelled exposed whole, and small it comes out (the 128K row of
           plan.published: about 4% of the step, under a tenth of its attention).
           Ulysses' all-to-alls are exposed whole. Which part overlaps is this
           project's choice, written down, not a measurement.
  TP       per layer and micro-batch, 4 all-reduces of b s h (6 with full recomputation;
           under sequence parallelism 4 all-gathers + 4 reduce-scatters + the 2
           all-gathers Megatron repeats in backward), the embedding's (first stage), the
           head's and the loss's (last stage); on NVLink when t fits in a node; exposed
           (Megatron does not overlap them in the published runs). Layout.tp_comm_overlap
           (Megatron-LM --tp-comm-overlap, Transformer Engine's userbuffers; needs SP): a
           layer's messages c run beside its GEMMs g, which lose TP_OVERLAP_SM_SHARE u of
           the GPU meanwhile (Calculon's NVLink "processor_usage" 0.15; TE's pipelined
           overlap takes 16-24 of 132 SMs): the layer takes max(c, g + u c), so
           max(c - g, u c) shows (this project's model); the ends' messages stay exposed
  bubble   (p-1)/v of one micro-batch's time on a mean stage (fill and drain cross every
           stage): the 1F1B and interleaved bubbles of plan.pipeline (Narayanan et al.
           2021, section 2.2). Stages of unequal layers (Layout.first_stage_layers,
           last_stage_layers): compute is the busiest stage's m micro-batches (the
           pipeline's pace), the bubble still the mean stage's (p-1)/v (the fill and the
           drain pass through all L layers once)
  PP       the busiest stage's point-to-point sends of b s h (2 v m on a middle stage,
           (2v - 1) m on an end one), plus the 2 (p - 1) transfers of the fill and the
           drain, on the critical path; across nodes each of the t ranks sends 1/t
           (Narayanan et al.'s scatter/gather, 4.1); the loss's broadcast and the tied
           embedding's sum between the end stages (GPT) on the link that spans them
  DP       the gradients' ring all-reduce (ZeRO: reduce-scatter + all-gather; stage 3 by
           units, one per layer) over the group's link (with CP, the dp x cp ranks; across
           nodes the node's NICs shared by the groups crossing at once, Cluster.link: a
           group of k GPUs per node moves at k NICs' bandwidth), in the buckets of
           Layout.bucket_bytes; under 1F1B it overlaps only the last micro-batch's
           backward, the rest is exposed; ZeRO 1-2's weight all-gather after the step
           hides behind the next step's first forward (Megatron's --overlap-param-gather),
           ZeRO 3's gathers and reduce-scatters behind each micro-batch's compute.
           ZeRO 2 with Layout.accumulate = k (Llama 3's FSDP, plan.memory) reduce-scatters
           every k micro-batches, m/k times, each behind k backwards, and holds one
           chunk's whole fp32 gradient meanwhile (plan.memory.accumulator_bytes).
  optimizer Adam over this GPU's share of the state, bound by HBM: it reads the K bytes
           of state and the g of gradient and writes the state and the w of weights,
           (2K + g + w) bytes per parameter (this project's count).
Not modelled: data loading, the all-gather over NVLink that completes the pipeline's
scatter/gather, the clipping norm's 8 bytes, stragglers, failures; DP and PP crossing nodes
in the same moment (each phase's NIC sharing is counted alone: Cluster.link); with CP, the exchange
a recomputed forward repeats and the transient buffers of one layer's exchange (all-gather:
K, V of the whole sequence, 2 b s kv hd/t values).

Memory (the most loaded GPU, of the first, the second and the last stage): model states by
ZeRO stage and precision (plan.memory) of the stage's parameters (Llama 3's FSDP is ZeRO 2,
plan.memory.LLAMA3_FSDP_ZERO); per layer what the model's own shape keeps
(plan.memory.layer_activation_bytes: Korthikanti et al.'s count for GPT's shape, the
SwiGLU, grouped-query and dropout-free terms for Llama's; the elementwise time above keeps
Korthikanti's GPT count as its proxy for HBM traffic); activations of the
micro-batches in flight on that stage (plan.pipeline.live_chunks: the first stage's is
plan.pipeline.in_flight; with lighter end stages, Llama 3's 7-8-...-8-7, the second can
hold more), the embedding on the first stage, the head and its logits on the last; with
CP each GPU keeps n = s/cp tokens' activations (the scores, when kept, 5 a n s b/t: its
queries against every key), the logits of n tokens, and model states
sharded by ZeRO over dp x cp. Rank order is Megatron's: tp innermost, then cp, then dp,
then pp (plan.layout); this engine's ProcessGrid orders tp, cp, pp, dp (pp before dp, kept
from the earlier lessons), which changes only which link a group lands on, not the bytes
one GPU sends (plan.step_bytes counts by its rank in each group).
"""
from dataclasses import dataclass, field

from minidist.plan import flops as F
from minidist.plan import gemm as G
from minidist.plan import step_bytes as SB
from minidist.plan.cluster import ranks_per_node
from minidist.plan.layout import Layout, Model, layout_stages, legal
from minidist.plan.memory import (ACCOUNTING, accumulator_bytes, korthikanti_layer_bytes,
                                  layer_activation_bytes, model_state_bytes)
from minidist.plan.pipeline import bubble_fraction, live_chunks
from minidist.plan.traffic import tp_sent

ACT_BYTES = 2              # 16-bit activations (bf16/fp16)
LOGIT_BYTES = 6            # a logit in 16 bits plus its fp32 copy for the loss (this project's count)
USABLE_MEMORY = 0.9        # fits: at most 90% of HBM (CUDA context, NCCL buffers, fragmentation)
TP_OVERLAP_SM_SHARE = 0.15  # the GEMMs' loss while TP messages overlap them: Calculon's
                           # "processor_usage" of its NVLink network (systems/a100_80g.json);
                           # Transformer Engine's userbuffers give a pipelined overlap 16-24 of
                           # H100's 132 SMs (Megatron/NeMo's ub configs' num_sm), 12-18%


@dataclass
class Estimate:
    model: Model
    layout: Layout
    gpu: str
    step_time_s: float
    compute_s: float
    elementwise_s: float       # the part of compute_s bound by HBM
    tp_s: float
    cp_s: float                # exposed context-parallel exchange (0 when cp = 1)
    pp_s: float
    dp_s: float
    bubble_s: float
    optimizer_s: float
    tokens_per_s: float
    model_flops: float
    hardware_flops: float
    tflops_per_gpu_model: float
    tflops_per_gpu_hardware: float
    mfu: float
    hfu: float
    memory: dict
    memory_bytes_per_gpu: float
    fits: bool
    lines: list = field(default_factory=list, repr=False)   # (quantity, formula, value)
    bytes_sent: dict = field(default_factory=dict)   # {"tp", "pp", "dp"(, "cp")}: bytes per step, plan.step_bytes
    bytes_stage: int = 0       # the pipeline stage (the busiest) whose first GPU bytes_sent counts

    def as_dict(self):
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "cp_variant": lay.cp_variant,
                "micro_batch": lay.micro_batch,
                "chunks": lay.chunks, "zero": lay.zero, "sequence_parallel": lay.sequence_parallel,
                "recompute": lay.recompute, "precision": lay.precision,
                "first_stage_layers": lay.first_stage_layers, "last_stage_layers": lay.last_stage_layers,
                "accumulate": lay.accumulate,
                "tp_comm_overlap": lay.tp_comm_overlap,
                "step_time_s": self.step_time_s, "compute_s": self.compute_s, "tp_s": self.tp_s,
                "cp_s": self.cp_s,
                "pp_s": self.pp_s, "dp_s": self.dp_s, "bubble_s": self.bubble_s,
                "optimizer_s": self.optimizer_s,
                "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu_model": self.tflops_per_gpu_model,
                "tflops_per_gpu_hardware": self.tflops_per_gpu_hardware,
                "mfu": self.mfu, "hfu": self.hfu, "memory": dict(self.memory),
                "memory_bytes_per_gpu": self.memory_bytes_per_gpu, "fits": self.fits,
                "bytes_sent": dict(self.bytes_sent), "bytes_stage": self.bytes_stage}


def _stage_params(model, layers, first, last, t):
    """Parameters one GPU of a stage holds: its layers' share (the matrices cut t ways,
    norms and row biases whole) and, on the first stage, the embedding (and GPT's position
    table); on the last, the head (Megatron keeps a copy of a tied embedding there) and the
    final norm: plan.step_bytes.stage_params, tensor by tensor."""
    return SB.stage_params(model, t, layers, first, last)


def estimate(model, cluster, layout):
    """The Estimate of one legal layout (module docstring); ValueError if it is not legal."""
    why = legal(model, cluster, layout)
    if why:
        raise ValueError(why)
    g, lay = cluster.gpu, layout
    t, p, d, b, v, cp = lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.chunks, lay.cp
    s, h, a, V, L = model.seq, model.hidden, model.heads, model.vocab, model.layers
    n = s // cp                                          # this GPU's tokens of each sequence
    m = model.global_batch // (d * b)
    layers = layout_stages(model, lay)                  # first, middle, last may differ
    lines = []

    def note(quantity, formula, value):
        lines.append((quantity, formula, value))
        return value

    # -- compute: matrix products at peak x efficiency, elementwise kernels at HBM speed
    rate = t * g.peak_flops * g.matmul_efficiency
    shape = dict(heads=a, ffn=model.ffn, kv_heads=model.kv, swiglu=model.swiglu)
    fwd = F.layer_flops(b, s, h, **shape) / cp           # this rank's 1/cp (load-balanced)
    attn = F.attention_score_flops(b, s, h) / cp
    again = {"none": 0, "selective": attn, "full": fwd}[lay.recompute]
    # the layer's GEMMs at their shapes on one TP rank (plan.gemm: tiles, waves, bytes),
    # forward, input and weight gradients; the attention scores at the matmul rate
    gemms, shaped = G.layer_gemms(model, b * n, t), cluster.gemm_shapes
    linear = sum(G.training_seconds(M, N, K, g, shaped) for _, M, N, K in gemms)
    linear_fwd = sum(G.gemm_seconds(M, N, K, g, shaped) for _, M, N, K in gemms)
    layer_matmul = linear + (3 * attn + again - (fwd - attn if lay.recompute == "full" else 0)) / rate
    layer_matmul += linear_fwd if lay.recompute == "full" else 0.0
    logits = G.training_seconds(*G.logit_gemm(model, b * n, t)[1:], g, shaped)
    scores = 5 * a * n * s * b / t                       # the n x s arrays in that count
    saved = korthikanti_layer_bytes(n, b, h, a, t, lay.sequence_parallel) - 5 * a * n * n * b / t
    saved += 0 if lay.flash_attention else scores
    # what one layer keeps, for the model's own shape (plan.memory.layer_activation_terms:
    # GQA's K, V, SwiGLU's three f-wide tensors, no dropout masks where the model has none);
    # GPT's shape gives Korthikanti's count above, to the flash kernel's log-sum-exp
    act = dict(ffn=model.ffn, kv_heads=model.kv, swiglu=model.swiglu, dropout=model.has_dropout,
               flash_attention=lay.flash_attention, keys=s)
    passes = 4 if lay.recompute == "full" else 3         # forward 1, backward 2, recomputed 1
    rerun = lay.recompute == "selective" and not lay.flash_attention
    elem_bytes = 2 * saved * passes + (2 * scores if rerun else 0)
    layer_elem = elem_bytes / g.hbm_bytes_per_s
    note("matmul rate per stage", "t x peak x matmul efficiency (FLOP/s)", rate)
    note("layer matmuls / micro-batch", "(3 x forward + recomputed) FLOPs / rate (s)", layer_matmul)
    note("layer elementwise / micro-b.", "2 x saved bytes x passes / HBM bandwidth (s)", layer_elem)

    # -- what each stage's first GPU sends (plan.step_bytes), timed on the links it crosses
    kinds = sorted({0, p - 1} | ({1} if p > 2 else set()))   # first, a middle one, last
    span = t * cp * d                                     # ranks of one pipeline stage
    cross = p > 1 and span >= cluster.gpus_per_node         # pipeline neighbours in other nodes
    sent = {i: SB.rank_sent(model, lay, layers[i], i, scatter_gather=cross) for i in kinds}
    gpn = cluster.gpus_per_node
    tp_link = cluster.link(t, ranks_per_node(1, t, gpn))
    tp_step = {i: SB.seconds(sent[i]["tp"], t, *tp_link) for i in kinds}
    # --tp-comm-overlap: one layer's TP messages per micro-batch (c) run beside its GEMMs (g),
    # which lose TP_OVERLAP_SM_SHARE (u) of the GPU meanwhile: the layer takes max(c, g + u c),
    # so max(c - g, u c) shows beyond g (this project's model of Megatron-LM/TE's overlap)
    tp_hidden = 0.0
    if lay.tp_comm_overlap and t > 1:
        one = tp_sent(b, n, h, 1, t, 0, ACCOUNTING[lay.precision][0], 1, False, False, True, True, 0,
                      False, int(lay.recompute == "full"))
        c = SB.seconds({k: v for k, v in one.items() if v[1]}, t, *tp_link)
        tp_hidden = c - max(c - linear - (linear_fwd if lay.recompute == "full" else 0.0),
                            TP_OVERLAP_SM_SHARE * c)
    # CP: one layer's exchange per micro-batch on the tp x cp span; the ring's hides
    # behind that layer's attention (forward + backward) as a causal kernel computes it,
    # s (s+1)/2 of the s x s scores (docstring); the others' are exposed
    causal = attn * (s + 1) / (2 * s)
    cp_link = cluster.link(t * cp, ranks_per_node(t, cp, gpn))
    cp_layer = SB.seconds(sent[0].get("cp", {}), cp, *cp_link) / (layers[0] * m)
    cp_hidden = 3 * causal / rate if lay.cp_variant == "ring" else 0.0
    cp_exposed = max(0.0, cp_layer - cp_hidden)

    def stage_time(i):
        extra = logits if i == p - 1 else 0.0
        tp_mb_i = tp_step[i] / m - layers[i] * tp_hidden
        return layers[i] * (layer_matmul + layer_elem) + extra, tp_mb_i + layers[i] * cp_exposed

    times = {i: stage_time(i) for i in kinds}
    busiest = max(kinds, key=lambda i: sum(times[i]))
    comp_mb = times[busiest][0]
    tp_mb, cp_mb = times[busiest][1] - layers[busiest] * cp_exposed, layers[busiest] * cp_exposed
    elem_mb = layers[busiest] * layer_elem
    mine = sent[busiest]
    note("TP per micro-batch", "busiest stage's TP: calls x steps x alpha + bytes/bw (s)", tp_mb)
    if cp > 1:
        note("CP per layer, micro-batch", f"{lay.cp_variant}: calls x steps x alpha + bytes/bw (s)",
             cp_layer)
        if lay.cp_variant == "ring":
            note("causal attention per layer", "3 x causal score FLOPs / cp / rate: hides the ring (s)",
                 cp_hidden)
    compute_s = note("compute", "m x busiest stage's compute per micro-batch (s)", m * comp_mb)
    tp_s = note("exposed TP", "m x busiest stage's TP time per micro-batch (s)", m * tp_mb)
    cp_s = note("exposed CP", "m x busiest stage's layers x exposed CP per layer (s)", m * cp_mb)

    # -- pipeline: the bubble, and the boundary transfers
    bubble_s = pp_s = 0.0
    if p > 1:
        frac = bubble_fraction("interleaved" if v > 1 else "1f1b", p, m, v)
        kind = {0: 0, p - 1: p - 1}
        tp_mean = sum(tp_step[kind.get(i, 1)] for i in range(p)) / (p * m) - L * tp_hidden / p
        mean_mb = (L * (layer_matmul + layer_elem + cp_exposed) + logits) / p + tp_mean   # fill, drain cross all
        bubble_s = float(frac / (1 - frac)) * m * mean_mb
        alpha, bw = cluster.link(span + 1)               # neighbours are t cp d ranks apart
        fill = 2 * (p - 1) * (alpha + SB.transfer_bytes(model, lay, cross) / bw)
        sends = {k: c for k, c in mine["pp"].items() if k == "send"}
        ends = {k: c for k, c in mine["pp"].items() if k != "send"}   # the loss, the tied table
        pp_s = (SB.seconds(sends, 2, alpha, bw) + fill       # ends: across the whole pipeline
                + SB.seconds(ends, p, *cluster.link((p - 1) * span + 1), {"all_reduce": 2}))
    note("bubble", "(p-1)/(v m) of m micro-batches on a mean stage (s)", bubble_s)
    note("exposed PP", "busiest stage's sends + 2 (p-1) fill/drain transfers (s)", pp_s)

    # -- data parallelism: gradients reduced over the dp (x cp) group's link
    params_stage = {i: _stage_params(model, layers[i], i == 0, i == p - 1, t) for i in kinds}
    psi = max(params_stage.values())
    w_item, g_item, _ = ACCOUNTING[lay.precision]
    dp_s, dc = 0.0, d * cp                               # Megatron reduces over dp x cp
    if dc > 1:
        dp_link = cluster.link(span, ranks_per_node(t, dc, gpn))   # dp x cp ranks, t apart

        def dp_time(*names):
            return SB.seconds({k: c for k, c in mine["dp"].items() if k in names}, dc, *dp_link)

        bwd = comp_mb * (2 * fwd + again) / (3 * fwd + again)    # last micro-batch's backward
        first_fwd = comp_mb * fwd / (3 * fwd + again)             # next step's first forward
        rs, ag = dp_time("reduce_scatter"), dp_time("all_gather")
        # ZeRO 1-2's weight all-gather hides behind the next step's first forward, as
        # Megatron's --overlap-param-gather does; ZeRO 3's gathers behind each micro-batch
        if lay.zero == 0:
            dp_s = max(0.0, dp_time("all_reduce") - bwd)
        elif lay.zero == 1:
            dp_s = max(0.0, rs - bwd) + max(0.0, ag - first_fwd)
        elif lay.zero == 2:                        # reduced after every k micro-batches' backward
            k = lay.accumulate or 1                # (k > 1: Llama 3's, accumulated locally in fp32)
            dp_s = m // k * max(0.0, rs * k / m - k * bwd) + max(0.0, ag - first_fwd)
        else:                                      # gathered for forward and backward, each micro-batch
            dp_s = m * max(0.0, (ag + rs) / m - comp_mb)
    note("exposed DP", ("all-reduce less the last backward (s)", "RS less last backward + AG less a "
                        "forward (s)", "m/k x (RS less k backwards) + AG less a forward (s)",
                        "m x (2 gathers + RS less a micro-batch) (s)")[lay.zero], dp_s)

    # -- the optimizer step: Adam reads and writes its state, bound by HBM
    k_item = ACCOUNTING[lay.precision][2]
    opt_psi = psi / dc if lay.zero >= 1 else psi
    opt_s = note("optimizer step", "Psi_gpu x (2K + g + w) bytes / HBM bandwidth (s)",
                 opt_psi * (2 * k_item + g_item + w_item) / g.hbm_bytes_per_s)

    step = compute_s + tp_s + cp_s + bubble_s + pp_s + dp_s + opt_s
    note("step time", "compute + TP + CP + bubble + PP + DP + optimizer (s)", step)
    model_flops, hw_flops = F.step_flops(model.global_batch, s, L, h, V, recompute=lay.recompute, **shape)
    n_gpu = cluster.gpus

    # -- memory on the first, the second and the last stage, the largest reported (the
    # second holds one micro-batch fewer in flight than the first, but with lighter end
    # stages, Llama 3's, more layers: it can be the fullest)
    keep = layer_activation_bytes(n, b, h, a, t, lay.sequence_parallel, lay.recompute, **act)
    work = (layer_activation_bytes(n, b, h, a, t, lay.sequence_parallel, "none", **act)
            if lay.recompute == "full" else 0.0)         # one layer rebuilt in backward

    def stage_memory(i):
        states = model_state_bytes(params_stage[i], dc, lay.zero, lay.precision)
        if lay.zero == 2 and (lay.accumulate or 1) > 1:      # one chunk's whole fp32 accumulator
            states["grads"] += accumulator_bytes(params_stage[i], v, lay.precision)
        # micro-batches in flight on stage i (plan.pipeline.live_chunks, Megatron's warm-up)
        flight = live_chunks("interleaved" if v > 1 else "1f1b", p, m, v, i) / v
        mem = dict(states, activations=flight * layers[i] * keep + work)
        if i == p - 1:
            mem["logits"] = b * n * V / t * LOGIT_BYTES
        return mem

    memory = max((stage_memory(i) for i in kinds), key=lambda x: sum(x.values()))
    total = sum(memory.values())
    note("memory on the fullest GPU", "states + activations (+ logits) (bytes)", total)
    return Estimate(model, lay, g.name, step, compute_s, m * elem_mb, tp_s, cp_s, pp_s, dp_s, bubble_s, opt_s,
                    model.global_batch * s / step, model_flops, hw_flops,
                    model_flops / step / n_gpu / 1e12, hw_flops / step / n_gpu / 1e12,
                    model_flops / (step * n_gpu * g.peak_flops), hw_flops / (step * n_gpu * g.peak_flops),
                    memory, total, total <= USABLE_MEMORY * g.memory_bytes, lines,
                    {k: SB.totals(row) for k, row in mine.items()}, busiest)


def describe(est):
    """The arithmetic of one estimate, one line per quantity: its name, its value, the
    formula in words (--explain); at most 100 columns."""
    lines = list(est.lines) + [
        ("model FLOPs per step", "3 x (layers + logits) forward FLOPs, plan.flops", est.model_flops),
        ("hardware FLOPs per step", "model FLOPs + the recomputed ones", est.hardware_flops),
        ("TFLOP/s per GPU, model", "model FLOPs / step / GPUs / 1e12", est.tflops_per_gpu_model),
        ("TFLOP/s per GPU, hardware", "hardware FLOPs / step / GPUs / 1e12", est.tflops_per_gpu_hardware),
        ("MFU", "model FLOP/s per GPU / dense peak", est.mfu),
        ("HFU", "hardware FLOP/s per GPU / dense peak", est.hfu),
        ("tokens per second", "global batch x sequence / step", est.tokens_per_s)]
    lines += [(f"memory: {k}", "bytes on the fullest GPU, plan.memory", v) for k, v in est.memory.items()]
    lines += [(f"bytes sent: {k}", f"per step by stage {est.bytes_stage}'s first GPU, plan.step_bytes", v)
              for k, v in est.bytes_sent.items()]
    return [f"  {q:<27}{value:>11.4g}  {formula}" for q, formula, value in lines]
