"""Memory per device: model states by ZeRO stage and precision, activations per layer. Over
400 lines but one idea: every byte count of one device's memory, the papers' and this
engine's side by side, plain arithmetic.

    python -m minidist.memory --params 7.5e9 --dp 64          (the calculator built on this)

Model states (Rajbhandari et al. 2020, arXiv 1910.02054, section 3 and Figure 1;
docs/reference.md#zero-memory-and-communication): w bytes of weights, g of gradients and
K of optimizer state per parameter. Over N_d data-parallel ranks, Psi parameters:
    stage 0 (plain data parallelism)   (w + g + K) Psi
    stage 1 (optimizer state cut)      (w + g) Psi + K Psi/N_d
    stage 2 (gradients too)            w Psi + (g + K) Psi/N_d
    stage 3 (weights too)              (w + g + K) Psi/N_d
The paper's example, 7.5B parameters on 64 devices, fp16 with Adam (2 + 2 + 12): 120,
31.4, 16.6 and 1.9 GB. Megatron-LM trains bf16 with fp32 main gradients, 2 + 4 + 12 =
18 B; its distributed optimizer is stage 1 of that: 6 + 12/d (Megatron-LM's documentation
of its distributed optimizer).

Activations per layer: Korthikanti et al. 2022 (arXiv 2205.05198) as the paper counts
them (16-bit values, 1-byte dropout masks); the same convention for the model's own shape
(layer_activation_terms: SwiGLU, grouped-query attention, no dropout, flash attention),
which the planner's cost model uses; and this engine's own array-by-array count
(engine_layer_saves), which the activation meter must equal exactly.

FSDP as Llama 3 ran it (section 3.3.2) is ZeRO stage 2: LLAMA3_FSDP_ZERO, below.

Over 400 lines as one idea: every byte a device holds (model states, the peaks the
lessons' strategies reach, activations), counted once, here.
"""
import math

from minidist.plan.rules import segments     # the cut of every-k checkpoints, the engine's own

# bytes per parameter of (weights, gradients, optimizer state)
ACCOUNTING = {
    "zero": (2, 2, 12),         # the ZeRO paper: fp16 weights and gradients; fp32 master, m, v
    "megatron": (2, 4, 12),     # Megatron-LM: bf16 weights, fp32 main gradients; fp32 master, m, v
    "fp32": (4, 4, 8),          # plain fp32 AdamW: weights, gradients, m, v
    "fp64": (8, 8, 16),         # this engine's float64 runs (the lessons' tests): the same, 8 B each
}


def model_state_bytes(psi, n_d, stage, accounting="zero"):
    """{"weights", "grads", "optimizer"}: bytes per device of Psi parameters at ZeRO stage
    0-3 over n_d data-parallel ranks (module docstring). accounting: a name of ACCOUNTING
    or a tuple (weight, gradient, optimizer) of bytes per parameter."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    if isinstance(accounting, str):
        if accounting not in ACCOUNTING:
            raise ValueError(f"accounting must be one of {sorted(ACCOUNTING)} or a tuple, "
                             f"not {accounting!r}")
        accounting = ACCOUNTING[accounting]
    w, g, k = accounting
    return {"weights": w * psi / (n_d if stage == 3 else 1),
            "grads": g * psi / (n_d if stage >= 2 else 1),
            "optimizer": k * psi / (n_d if stage >= 1 else 1)}


def bytes_per_param(accounting, n_d=1, stage=0):
    """Model-state bytes per parameter: sum of model_state_bytes of one parameter.
    bytes_per_param("zero") = 16, ("megatron") = 18, ("fp32") = 16; Megatron's distributed
    optimizer, bytes_per_param("megatron", d, 1) = 6 + 12/d."""
    return sum(model_state_bytes(1, n_d, stage, accounting).values())


def engine_state_bytes(stage, psi, n_d, itemsize, k_bytes=None):
    """{"params", "grads", "optimizer"}: what this engine's ZeRO (parallel/zero.py) holds
    after a step, by the paper's accounting in the run's dtype: weights and gradients of
    `itemsize` bytes, AdamW's m and v (2 itemsize per parameter; k_bytes to override: 12
    for mixed precision's fp32 master, m and v).

    One difference, this implementation's choice: stage 1 keeps the whole local gradient
    beside its reduced partition until the step, Psi + Psi/N_d (DeepSpeed's stage 1 does
    too); the paper counts Psi. Psi/N_d is the paper's even cut; the engine's partitions
    are numpy.array_split's, up to one element apart."""
    k_bytes = 2 * itemsize if k_bytes is None else k_bytes
    s = model_state_bytes(psi, n_d, stage, (itemsize, itemsize, k_bytes))
    kept = itemsize * psi / n_d if stage == 1 else 0      # stage 1's reduced partition
    return {"params": s["weights"], "grads": s["grads"] + kept, "optimizer": s["optimizer"]}


def zero_grad_peak_bytes(stage, psi, n_d, itemsize, micro_batches=1, overlap=False, root=0, block=0,
                         filling=0):
    """Gradient bytes alive at the peak of a step of this engine's ZeRO (parallel/zero.py),
    by the stage's rule. Stage 0: Psi; 1: Psi + Psi/N (the local gradient and the reduced
    partition); 2 without overlap: Psi, + Psi/N with several micro-batches. Bounds, the
    buckets or units alive at once depending on where backward is at the peak: stage 2
    overlapped, Psi/N + `block` elements in flight + `filling` bytes (the full-size .grad
    of buckets still filling, measured); stage 3, Psi/N + the root unit + one block."""
    part = psi * itemsize / n_d
    if stage == 0:
        return psi * itemsize
    if stage == 1:
        return psi * itemsize + part
    if stage == 2 and not overlap:
        return psi * itemsize + (part if micro_batches > 1 else 0)
    if stage == 2:
        return part + block * itemsize + filling
    return part + (root + block) * itemsize


def fsdp_gathered_units(unit_bytes, reshard=True, prefetch=True):
    """The gathered units' bytes alive at FSDP's peak (parallel/fsdp.py), unit_bytes[0] the
    root (embeddings, ln_f: gathered from forward to backward). Resharding after forward:
    the root and the largest block, and the next largest when prefetch gathers one ahead;
    without it every unit, none freed before its backward. Their sum is the peak."""
    blocks = sorted(unit_bytes[1:], reverse=True)
    if not reshard:
        return list(unit_bytes)
    return [unit_bytes[0]] + blocks[:2 if prefetch and len(blocks) > 1 else 1]


def tp_weight_bytes(sharded, replicated, t, itemsize):
    """Weight bytes per rank under tensor parallelism: 1/t of the `sharded` elements (the
    vocabulary padded to a multiple of t included) and every `replicated` one."""
    return (sharded // t + replicated) * itemsize


def kv_cache_bytes(batch, seq, layers, h, itemsize, t=1):
    """A KV cache of `seq` positions: keys and values of width h in every layer,
    2 b s L h itemsize, cut by t under tensor parallelism (each rank its heads)."""
    return 2 * batch * layers * seq * h * itemsize // t


def checkpoint_data_bytes(psi, itemsize, step_bytes=8):
    """The data a checkpoint of this project's format (minidist/checkpoint) holds, headers
    aside: Psi weights and AdamW's m and v in the run's dtype, and the step count (one int64,
    checkpoint/layouts.py): 3 Psi itemsize + 8, however the ranks cut it into files."""
    return 3 * psi * itemsize + step_bytes


# ------------------------------------------------------------------------ activations, the paper

ATTENTIONS = ("plain", "blockwise")   # the attention cores (model.GPTConfig.attention)



def korthikanti_layer_bytes(s, b, h, a, t=1, sequence_parallel=False):
    """Korthikanti et al. 2022 (arXiv 2205.05198), activation bytes per layer per rank with
    16-bit activations and 1-byte dropout masks: 34sbh + 5as^2b without tensor
    parallelism (t = 1), 10sbh + 24sbh/t + 5as^2b/t with it, 34sbh/t + 5as^2b/t with
    sequence parallelism too (their eq. 1, 2 and 4;
    docs/reference.md#activation-memory-per-layer)."""
    sbh, as2b = s * b * h, a * s * s * b
    if t == 1:
        return 34 * sbh + 5 * as2b
    if sequence_parallel:
        return 34 * sbh / t + 5 * as2b / t
    return 10 * sbh + 24 * sbh / t + 5 * as2b / t


def activation_layer_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none",
                           attention="plain"):
    """Bytes of activations one layer keeps for backward, per tensor-parallel rank:
    korthikanti_layer_bytes for "none"; "selective" recomputes the attention scores and
    drops their 5as^2b/t; "full" keeps each layer's input, 2sbh (divided by t under
    sequence parallelism) (Korthikanti et al. 2022, section 5 and Table 2).

    attention="blockwise" (FlashAttention, Dao et al. 2022): the 5as^2b/t are never kept,
    and the row log-sum-exp adds 4asb/t (fp32); its output is the projection's input,
    already in the 34sbh. Selective recomputation then has nothing left to drop."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, not {attention!r}")
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    full = korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
    if attention == "blockwise":
        return full - 5 * a * s * s * b / t + 4 * a * s * b / t
    if recompute == "selective":
        return full - 5 * a * s * s * b / t
    return full


# ------------------------------------------------------- activations, by the model's shape

def layer_activation_terms(s, b, h, a, t=1, sequence_parallel=False, ffn=None, kv_heads=None,
                           swiglu=False, dropout=True, flash_attention=False, keys=None):
    """{term: bytes} one layer keeps for backward per tensor-parallel rank, in Korthikanti et
    al.'s convention (arXiv 2205.05198, section 4.1: 16-bit activations, a 1-byte mask per
    dropout, every tensor a backward reads counted once; layer-norm statistics and other
    per-token scalars left out), for the model's own shape. keys: the keys each query
    attends to (s; under context parallelism s tokens of keys for s/cp queries).

    Their section 4.1 counts GPT's layer, 34sbh + 5as^2b at t = 1:
      attention 11sbh + 5as^2b: the QKV input 2sbh, Q and K 4sbh, V 2sbh, the softmax
      output 2as^2b, its dropout mask as^2b, the dropped-out probabilities 2as^2b (the
      input of the product with V), the output projection's input 2sbh, the dropout mask
      after it sbh; MLP 19sbh: its input 2sbh, the GELU's input 8sbh (4h wide), the second
      matrix's input 8sbh, the dropout mask sbh; two layer norms' inputs 4sbh.
    With tensor parallelism the layer norms' inputs, the two column layers' inputs and the
    two dropout masks (10sbh) are whole on every rank and the rest is cut t ways
    (10sbh + 24sbh/t + 5as^2b/t, their eq. 2); sequence parallelism cuts those too (34sbh/t
    + 5as^2b/t, eq. 4). Those inputs are the same here, whatever the shape.

    What this counts differently, term by term, where the model is not GPT's:
      - K and V at kv_heads heads (grouped-query attention, Ainslie et al. 2023): 2 x 2sb
        h_kv, h_kv = kv_heads h/a, for GPT's 4sbh (Q stays 2sbh);
      - MLP of width f (ffn; GPT's 4h): GELU keeps its input and the second matrix's input,
        2 x 2sbf; SwiGLU, down(silu(gate x) * up x), keeps gate's and up's outputs, 2 x
        2sbf, and their product, down's input, 2sbf (silu(gate x) recomputed in backward,
        as Megatron-LM's fused bias-SwiGLU does): 6sbf;
      - dropout=False (Llama): no masks (the 2sbh after attention and MLP, the scores' as^2b)
        and the softmax output is the product's input itself, 2as^2b in place of 5as^2b;
      - flash_attention (Dao et al. 2022): no s x s arrays; the kernel keeps its output
        (already the projection's input) and the rows' log-sum-exp, 4asb in fp32.
    RMSNorm keeps its input as a layer norm does (2sbh each). With GPT's shape (f = 4h,
    kv_heads = a, GELU, dropout) the terms add up to korthikanti_layer_bytes exactly.
    """
    f = 4 * h if ffn is None else ffn
    h_kv = h if kv_heads is None else kv_heads * (h // a)
    k = s if keys is None else keys
    sbh = s * b * h
    whole = t if sequence_parallel else 1          # the 10sbh whole on every rank without SP
    d = 1 if dropout else 0
    terms = {"norm inputs": 4 * sbh / whole,
             "QKV input": 2 * sbh / whole,
             "Q": 2 * sbh / t,
             "K, V": 4 * s * b * h_kv / t,
             "attention output (projection input)": 2 * sbh / t,
             "attention dropout mask": d * sbh / whole,
             "MLP input": 2 * sbh / whole,
             "MLP dropout mask": d * sbh / whole}
    if flash_attention:
        terms["log-sum-exp (fp32)"] = 4 * a * s * b / t
    else:
        terms["scores (softmax output, masks)"] = (5 if dropout else 2) * a * s * k * b / t
    if swiglu:
        terms["gate, up outputs"] = 4 * s * b * f / t
        terms["gate x up (down's input)"] = 2 * s * b * f / t
    else:
        terms["GELU input"] = 2 * s * b * f / t
        terms["second matrix input"] = 2 * s * b * f / t
    return terms


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none",
                           ffn=None, kv_heads=None, swiglu=False, dropout=True,
                           flash_attention=False, keys=None):
    """Bytes one layer keeps for backward per tensor-parallel rank, for the model's shape:
    layer_activation_terms added up ("none"); "selective" drops the s x s scores
    (Korthikanti et al. 2022, section 5: the attention core is recomputed), "full" keeps the
    layer's input, 2sbh (/t under sequence parallelism). GPT's shape gives
    activation_layer_bytes' plain and (up to the log-sum-exp) blockwise counts."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
    terms = layer_activation_terms(s, b, h, a, t, sequence_parallel, ffn, kv_heads, swiglu,
                                   dropout, flash_attention, keys)
    if recompute == "selective":
        terms.pop("scores (softmax output, masks)", None)
    return sum(terms.values())


# --------------------------------------------------------- FSDP as Llama 3 ran it

FSDP_ZERO_STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
LLAMA3_FSDP_ZERO = 2
"""Llama 3's FSDP as a ZeRO stage. Grattafiori et al. 2024 (arXiv 2407.21783), section
3.3.2: "Our use of FSDP for Llama 3 shards optimizer states and gradients, but for model
shards we do not reshard after forward computation to avoid an extra all-gather
communication during backward passes", and (Numerical stability) "we use FP32 gradient
accumulation during backward computation over multiple micro-batches and also
reduce-scatter gradients in FP32 across data parallel workers in FSDP". PyTorch's
ShardingStrategy (torch/distributed/fsdp/api.py) names that behaviour SHARD_GRAD_OP:
"Gradients and optimizer states are sharded during computation, and additionally,
parameters are sharded outside computation ... unshards before the forward, does not
reshard them after the forward, and only reshards them after the backward computation",
ZeRO's stage 2 (Rajbhandari et al. 2020: P_os+g). So, at the step's peak (forward and
backward): whole 16-bit weights of the GPU's stage, w Psi, and fp32 gradients and the
optimizer's fp32 master, m and v cut over the data-parallel ranks, (g + K) Psi/N_d, with
ACCOUNTING["megatron"] (2, 4, 12): model_state_bytes(psi, n_d, LLAMA3_FSDP_ZERO, "megatron").

When the gradients are reduce-scattered is this project's reading, not the paper's words.
The paper names two things: FP32 gradient accumulation "over multiple micro-batches", and
gradients sharded. Two readings keep one and drop the other: accumulate the whole
gradient over every micro-batch, one reduce-scatter per step (Megatron's distributed
optimizer, ZeRO 1: a whole fp32 gradient, 4 Psi, the step through: 12.8 GB per GPU of the
405B rows, which then need 94.9 GB at 8,192 GPUs); or reduce-scatter every micro-batch
(ZeRO 2 as this engine runs it: 32 and 16 reduce-scatters of the fp32 gradient per step,
which the cost model times mostly exposed). The reading kept here satisfies both, with
the schedule the paper describes beside it: its pipeline runs N contiguous micro-batches
through one model chunk (Figure 6; N = PP, depth-first, is Megatron-LM's
--microbatch-group-size-per-virtual-pipeline-stage default), so a rank accumulates a
chunk's gradient locally in fp32 over those N backward passes, then reduce-scatters it
once into its fp32 shard and frees it: M/N reduce-scatters per step (Layout.accumulate =
N), and, beside the sharded states, the whole fp32 gradient of one chunk at a time,
accumulator_bytes. Transients not counted: the bucket in flight, the sharded weights'
16-bit copy outside computation.

What that does to the 405B rows (plan.published; pp 16, 8 chunks of one layer, TP 8 with
sequence parallelism, micro-batch 1): on the fullest GPU, the second stage's (8 layers),
6.4 GB of whole bf16 weights, 0.2 / 0.1 GB of sharded fp32 gradients, 0.6 / 0.3 GB of
Adam state, 1.6 GB for one layer's fp32 accumulator, and activations of 141 (8,192 GPUs,
M 32) or 128 (16,384 GPUs, M 16: every micro-batch) layer-micro-batches of 533 MB each:
75.2 / 68.2 GB. Totals 83.9 / 76.6 GB against the planner's 77.0 GB (90% of the H100's
85.5e9 bytes, nvidia-smi's 81,559 MiB): the 16,384-GPU rows fit, with 0.4 GB to spare; the
8,192-GPU row does not (its 32 micro-batches fill the interleaved warm-up, 141 layer-micro-
batches, where 16 end it at 128). Of the 533 MB, SwiGLU's three f-wide tensors
are 327 MB (6 s b f / t, what Megatron-LM's fused SwiGLU keeps). The paper's other memory
measures change nothing in this count: its lighter end stages are already the layout, the
deallocated "input and output tensors of each pipeline stage" are buffers this count
never held (a stage's received input is counted once, as its first norm's input), and N
is no help: N = PP holds least (Megatron-LM requires N >= PP; a larger N holds more).
The paper does not give V, N or what its kernels keep; that it ran at 8,192 GPUs without
activation checkpointing says its per-layer count there was at least 9% lower than
Korthikanti's convention gives for this shape (68.2 GB of room for 75.2).
"""


def accumulator_bytes(psi_stage, chunks=1, accounting="megatron"):
    """Bytes of the whole gradient of one model chunk (psi_stage / chunks parameters) in the
    gradients' itemsize: what a ZeRO-2 rank holds while it accumulates that chunk's gradient
    locally over several micro-batches before one reduce-scatter (LLAMA3_FSDP_ZERO's
    reading; Layout.accumulate). 405B's 8 layers per GPU at TP 8, 8 chunks: 1.6 GB."""
    g = ACCOUNTING[accounting][1] if isinstance(accounting, str) else accounting[1]
    return g * psi_stage / chunks


# ---------------------------------------------------------------------- activations, this engine

LN = "layer norms: normalised input (2 x b*s*h)"
LN_STD = "layer norms: 1/std per token (2 x b*s)"
COL_IN = "c_attn, c_fc: input (2 x b*s*h; under SP 2 x b*s*h/t, or whole if kept gathered)"
QKV = "attention: q/sqrt(hs), k, v (3 x b*s*h/t)"
PROBS = "attention: probabilities (a*s^2*b/t)"
MASKS = "dropout masks after attention and MLP (2 x b*s*h)"
ATT_MASK = "attention dropout mask (a*s^2*b/t)"
ATT_QKV = "blockwise attention: q, k, v (3 x b*s*h/t)"
ATT_OUT = "blockwise attention: output o (b*s*h/t)"
ATT_LSE = "blockwise attention: log-sum-exp per row (a*s*b/t)"


def engine_layer_saves(b, s, h, a, t=1, s_r=None, dropout=True, regather=True, attention="plain"):
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

    attention="blockwise" (minidist/attention.py) keeps q, k, v, its output o and the
    row log-sum-exp in place of the probabilities and the dropout mask (regenerated from
    positions): the core's a*s^2*b/t (2 a*s^2*b/t with dropout; Korthikanti et al.'s 5as^2b
    in their 16-bit, 1-byte-mask units) become b*s*h/t + a*s*b/t.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, not {attention!r}")
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
    if attention == "blockwise":
        at = next(i for i, x in enumerate(saves) if x[1] == QKV)
        saves[at:at + 3] = [("core", ATT_QKV, 3 * b * s * h // t),
                            ("core", ATT_OUT, b * s * h // t), ("core", ATT_LSE, a * s * b // t)]
    return [x for x in saves if dropout or x[1] not in (MASKS, ATT_MASK)]


def engine_layer_elements(b, s, h, a, t=1, s_r=None, dropout=True, regather=True,
                          attention="plain"):
    """Elements one transformer layer saves for backward on one rank, {what: elements},
    engine_layer_saves added up line by line. With s_r = s/t and regather, every line is
    1/t of one process's (t = 1): Korthikanti et al.'s identity, 34sbh/t + 5as^2b/t.
    attention: "plain" or "blockwise" (engine_layer_saves)."""
    out = {}
    for _, what, n in engine_layer_saves(b, s, h, a, t, s_r, dropout, regather, attention):
        out[what] = out.get(what, 0) + n
    return out


def recompute_peak_elements(policy, n_layer, b, s, h, a, t=1, s_r=None, dropout=True, k=None,
                            regather=True, attention="plain"):
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
      With attention="blockwise" the core keeps nothing of size s^2 and is not
      checkpointed: selective is none.
    """
    saves = engine_layer_saves(b, s, h, a, t, s_r, dropout, regather, attention)
    if policy == "selective" and attention == "blockwise":
        policy = "none"
    A = sum(n for _, _, n in saves)
    x = b * (s if s_r is None else s_r) * h
    L = n_layer
    if policy == "none":
        return L * A
    if policy in ("full", "every-k"):
        segs = segments(L, 1 if policy == "full" else k)
        rebuilt = max((j + 1) * x + (hi - lo) * A for j, (lo, hi) in enumerate(segs))
        return max(len(segs) * x, rebuilt)
    if policy == "selective":
        core = sum(n for part, _, n in saves if part == "core")
        before = sum(n for part, _, n in saves if part == "before")
        qkv = 3 * b * s * h // t
        kept = A - core + qkv
        return max(L * kept, (L - 1) * kept + before + qkv + core)
    raise ValueError(f"unknown recomputation policy {policy!r}")


def best_every_k(n_layer, x_bytes, a_bytes):
    """The k of every-k checkpointing that keeps the least, as a real number: segments of k
    blocks keep (L/k) x + k A (recompute_peak_elements, about), least at k = sqrt(L x / A),
    x a block's input and A one block's saves. Chen et al. 2016 (arXiv 1604.06174, section
    4.1) count O(n/k) + O(k) and take k = sqrt(n): this rule with x = A. Weighing x against
    A is this project's reading of the same sum."""
    return math.sqrt(n_layer * x_bytes / a_bytes)
