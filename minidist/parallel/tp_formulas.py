"""Tensor parallelism's formulas, which lesson 03 prints beside its measurements and the
tests hold the measurements to: bytes each rank sends (training and generation) and
activation memory per layer, as this engine saves it and as Korthikanti et al. 2022
count it. Kept apart from the layers (tensor_parallel.py) and the model (tp_model.py)
so that lessons, tests and a planner share one copy, and so that reading the layers is
not interrupted by accounting.

    python -c "from minidist.parallel.tp_formulas import korthikanti_layer_bytes as k; print(k(2048, 1, 12288, 96, 8))"
"""
import numpy as np

from minidist.plan.collectives import ring_all_gather_sent, ring_all_reduce_sent, ring_reduce_scatter_sent  # noqa: F401
from minidist.tensor import MEMORY

# ----------------------------------------------------------------------------- bytes, by formula


def expected_bytes(model, batch, T, micro_batches=1, clip=True, dp_comm=None, recomputed_layers=0, stage=None):
    """{collective: (calls, bytes)} this rank sends in one training step.

    Per micro-batch of `batch` sequences of T tokens (h = n_embd, L layers):
    - plain TP: all-reduces of b*s*h: 2 per layer forward (g) and 2 backward (f), one for
      the embedding (g) and one for the head's input (f); 3 of b*s for the loss;
    - sequence parallel: those 4L + 2 all-reduces become as many all-gathers plus as
      many reduce-scatters along the sequence; the loss keeps its 3 all-reduces; and
      unless the model keeps the gathered inputs (sp_keep_gathered), c_attn and c_fc
      all-gather their input again in backward: 2L more all-gathers (6 all-gathers and
      4 reduce-scatters per layer);
    per step: under SP, one all-reduce of the replicated parameters' gradients; with
    clipping, one all-reduce of one float64 (the squared norm of the shards,
    TensorParallelSync.grad_norm_sq); with a
    data-parallel group (NaiveDataParallel), one ring all-reduce per parameter shard.
    recomputed_layers: layers whose forward runs again in backward (activation
    recomputation, minidist/recompute.py: L for full and every-k, 0 for selective, whose
    attention core has no collective): each repeats its 2 forward g's (under SP its 2
    reduce-scatters and 2 all-gathers) per micro-batch.
    stage: the pipeline stage this rank runs (pipeline_parallel.PipelineGPT over this
    model, 3D parallelism): only its layers communicate, the embedding's g on the first
    stage, the head's f and the loss's 3 on the last; only its parameters are averaged.
    """
    cfg, t, r = model.config, model.tp, model.tp_rank
    item = np.dtype(cfg.dtype).itemsize
    L, C, k = cfg.n_layer, cfg.n_embd, micro_batches
    first, last, params = True, True, model.parameters()
    if stage is not None:
        L = sum(hi - lo for lo, hi in (stage.ranges[s] for s in stage.stages))
        first, last, params = stage.first, stage.last, stage.parameters()
    n_big = 4 * L + first + last + 2 * recomputed_layers
    regathers = 0 if model.sp_keep_gathered else 2 * L           # c_attn's and c_fc's, in backward
    out = {"all_reduce": [0, 0], "all_gather": [0, 0], "reduce_scatter": [0, 0]}

    def add(name, calls, elements, itemsize=item):
        out[name][0] += calls
        out[name][1] += elements * itemsize

    if model.sequence_parallel:
        n_ag = n_big + regathers
        add("all_gather", k * n_ag, k * n_ag * ring_all_gather_sent(T, batch * C, t, r))
        add("reduce_scatter", k * n_big, k * n_big * ring_reduce_scatter_sent(T, batch * C, t, r))
        n_rep = sum(p.size for n, p in model.named_parameters() if n not in model.specs)
        add("all_reduce", 1, ring_all_reduce_sent(n_rep, t, r))
    else:
        add("all_reduce", k * n_big, k * n_big * ring_all_reduce_sent(batch * T * C, t, r))
    if last:
        add("all_reduce", 3 * k, 3 * k * ring_all_reduce_sent(batch * T, t, r))
    if clip:
        add("all_reduce", 1, ring_all_reduce_sent(1, t, r), itemsize=8)
    if dp_comm is not None and dp_comm.Get_size() > 1:
        calls, sent = dp_all_reduce_bytes(params, dp_comm)
        out["all_reduce"][0] += calls
        out["all_reduce"][1] += sent
    return {name: tuple(v) for name, v in out.items() if v[0]}


def dp_all_reduce_bytes(params, dp_comm):
    """(calls, bytes) this rank sends averaging `params`' gradients over the replicas of
    dp_comm as NaiveDataParallel does: one ring all-reduce per parameter."""
    n, r = dp_comm.Get_size(), dp_comm.Get_rank()
    return len(params), sum(ring_all_reduce_sent(p.size, n, r) * p.data.itemsize for p in params)

def generation_bytes(model, batch, positions):
    """{"all_reduce": (calls, bytes)} this rank sends for one step of generation that feeds
    `positions` new tokens of `batch` sequences: g after the embedding and after each
    layer's attention and MLP (2L + 1 all-reduces of b*positions*h), then the two of b
    numbers of vocab_parallel_argmax (the logits' dtype, then int64 ids)."""
    cfg, t, r = model.config, model.tp, model.tp_rank
    item = np.dtype(cfg.dtype).itemsize
    n = 2 * cfg.n_layer + 1
    sent = n * ring_all_reduce_sent(batch * positions * cfg.n_embd, t, r) * item
    sent += ring_all_reduce_sent(batch, t, r) * (item + 8)
    return {"all_reduce": (n + 2, sent)}

def generation_feeds(prompt, n, block_size):
    """How many positions each of minidist.model.generate_greedy's n steps feeds: the
    prompt, then one token a step while the sequence fits in block_size, then the
    cropped window of block_size (positions shift, nothing cached is valid)."""
    out, length = [], prompt
    for step in range(n):
        out.append(prompt if step == 0 else (1 if length <= block_size else block_size))
        length += 1
    return out

# ----------------------------------------------------------------------------- activation memory


LN = "layer norms: normalised input (2 x b*s*h)"
LN_STD = "layer norms: 1/std per token (2 x b*s)"
COL_IN = "c_attn, c_fc: input (2 x b*s*h; under SP 2 x b*s*h/t, or whole if kept gathered)"
QKV = "attention: q/sqrt(hs), k, v (3 x b*s*h/t)"
PROBS = "attention: probabilities (a*s^2*b/t)"
MASKS = "dropout masks after attention and MLP (2 x b*s*h)"
ATT_MASK = "attention dropout mask (a*s^2*b/t)"


def engine_layer_saves(b, s, h, a, t=1, s_r=None, dropout=True, regather=True):
    """[(part, what, elements)]: the arrays one transformer layer saves for backward on one
    rank, in the order its forward saves them (fused.py, ops.py). part: "before", "core"
    or "after" the attention core (what selective recomputation reruns); what: the
    line of engine_layer_elements it counts in.

    t = 1: one process. s_r: this rank's tokens under sequence parallelism (None: plain
    tensor parallelism, the residual stream whole on every rank). regather, under SP:
    c_attn and c_fc save only this rank's tokens and gather them again in backward
    (Megatron's way, TensorParallelGPT's default); False counts the keep-gathered
    variant (sp_keep_gathered), whose column layers save the whole gathered input.
    Weights a node saves are parameters, not activations, and are not counted
    (minidist/context.py).
    """
    res = s if s_r is None else s_r                     # tokens of the residual stream here
    col = s_r if (s_r is not None and regather) else s  # tokens c_attn and c_fc keep
    d = bool(dropout)
    saves = [("before", LN, b * res * h), ("before", LN_STD, b * res),         # ln_1
             ("before", COL_IN, b * col * h),                                    # c_attn
             ("core", QKV, 3 * b * s * h // t), ("core", PROBS, a * s * s * b // t),
             ("core", ATT_MASK, d * a * s * s * b // t),
             ("after", "attn.c_proj: input (b*s*h/t)", b * s * h // t),
             ("after", MASKS, d * b * res * h),                                  # resid_dropout
             ("after", LN, b * res * h), ("after", LN_STD, b * res),             # ln_2
             ("after", COL_IN, b * col * h),                                     # c_fc
             ("after", "GELU: input (4 b*s*h/t)", 4 * b * s * h // t),
             ("after", "mlp.c_proj: input (4 b*s*h/t)", 4 * b * s * h // t),
             ("after", MASKS, d * b * res * h)]                                  # mlp dropout
    return [x for x in saves if dropout or x[1] not in (MASKS, ATT_MASK)]


def engine_layer_elements(b, s, h, a, t=1, s_r=None, dropout=True, regather=True):
    """Elements one transformer layer saves for backward on one rank, {what: elements},
    engine_layer_saves added up line by line. With s_r = s/t and regather, every line is
    1/t of one process's (t = 1): Korthikanti et al.'s identity, 34sbh/t + 5as^2b/t."""
    out = {}
    for _, what, n in engine_layer_saves(b, s, h, a, t, s_r, dropout, regather):
        out[what] = out.get(what, 0) + n
    return out


def recompute_peak_elements(policy, n_layer, b, s, h, a, t=1, s_r=None, dropout=True, k=None, regather=True):
    """The meter's peak over the forward and backward of n_layer blocks under a
    recomputation policy (minidist/recompute.py), in elements, as this engine saves them.

    With A one layer's saves (engine_layer_saves) and x = b*s*h a block's input:
    - none: L A, at the end of the forward;
    - full / every-k (segments of k blocks): the forward keeps one input per segment;
      rebuilding segment j in backward adds its blocks' A while the inputs of segments
      0..j are still kept: max over j of (j + 1) x + (blocks of j) A. full (k = 1):
      L x + A. About (L/k) x + k A, least at k = sqrt(L x / A); Chen et al. 2016's
      k = sqrt(L) gives about sqrt(L) (x + A);
    - selective: each layer keeps q, k, v in place of the core's arrays (q/sqrt(hs),
      k, v, probabilities, mask); the last layer's rerun adds the core again beside its
      checkpoint's q, k, v (the meter counts an array once per node that saves it).
    """
    from minidist.recompute import segments        # the same cut the policy makes
    saves = engine_layer_saves(b, s, h, a, t, s_r, dropout, regather)
    A = sum(n for _, _, n in saves)
    x = b * (s if s_r is None else s_r) * h
    L = n_layer
    if policy == "none":
        return L * A
    if policy in ("full", "every-k"):
        segs = segments(L, 1 if policy == "full" else k)
        return max(len(segs) * x, max((j + 1) * x + (hi - lo) * A for j, (lo, hi) in enumerate(segs)))
    if policy == "selective":
        core = sum(n for part, _, n in saves if part == "core")
        before = sum(n for part, _, n in saves if part == "before")
        qkv = 3 * b * s * h // t
        kept = A - core + qkv
        return max(L * kept, (L - 1) * kept + before + qkv + core)
    raise ValueError(f"unknown recomputation policy {policy!r}")


def korthikanti_layer_bytes(s, b, h, a, t=1, sequence_parallel=False):
    """Korthikanti et al. 2022 (arXiv 2205.05198), activation bytes per layer per rank with
    16-bit activations and 1-byte dropout masks: 34sbh + 5as^2b without tensor
    parallelism (t = 1), 10sbh + 24sbh/t + 5as^2b/t with it, 34sbh/t + 5as^2b/t with
    sequence parallelism too (their eq. 1, 2 and 4; docs/reference.md#activation-memory-per-layer)."""
    sbh, as2b = s * b * h, a * s * s * b
    if t == 1:
        return 34 * sbh + 5 * as2b
    if sequence_parallel:
        return 34 * sbh / t + 5 * as2b / t
    return 10 * sbh + 24 * sbh / t + 5 * as2b / t


def measured_saved_bytes(forward):
    """The activation meter's reading (minidist.context.MEMORY) for one training forward:
    the bytes its nodes saved for backward, read while the output keeps them alive.

    forward: a function of no arguments that runs the forward (one transformer layer,
    say) and returns its output. Under tensor parallelism every rank of the group must
    call it together: the layer communicates.
    """
    before = MEMORY.live_bytes
    y = forward()
    saved = MEMORY.live_bytes - before
    del y                                                # the graph goes, and its bytes with it
    return saved
