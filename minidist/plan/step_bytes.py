"""Bytes one GPU sends in one step of a layout, by group, counted as this engine sends them:
what the planner reports (cost.Estimate.bytes_sent) and what it times (cost.estimate).

    python -c "from minidist.plan.cost import *; from minidist.plan.cluster import make_cluster; \\
               print(estimate(Model(8, 16, 8, 30, 4, 8), make_cluster('h100-sxm', 8),
                              Layout(2, 2, 2, 1, zero=1, precision='fp64')).bytes_sent)"

The counts are plan.traffic's *_sent functions (the ones the lessons' counters equal to the
byte, tests/mpi/test_3d_parallel.py and others) fed with a planned rank's numbers:
  tp  tp_sent: per layer and micro-batch 4 all-reduces of b s h (sequence parallelism:
      4 all-gathers + 4 reduce-scatters, + 2 all-gathers repeated in backward, + one
      all-reduce of the replicated parameters' gradients per step), the embedding's on the
      first stage, the head's and the loss's 3 of b s on the last, 2 more per layer with
      full recomputation; in the activations' itemsize (the weights', ACCOUNTING)
  pp  pp_sent: b s h per micro-batch and boundary, forward from every chunk that is not the
      last virtual stage, backward from every one that is not the first (across nodes
      Megatron's scatter/gather: 1/t of it each, Narayanan et al. 2021, section 4.1; the
      engine never crosses nodes and sends it whole); the loss, one float64 from the last
      stage to each other; GPT's tied embedding, a ring all-reduce of its two copies
  dp  zero_sent of the layout's flat buffers (stage 1: one; stage 2: its buckets; stage 3:
      the units, the ends first, then one per layer) or dp_sent of its all-reduces
      (stage 0), gradients in the gradients' itemsize, weights in the weights'.
  cp  context parallelism (Layout.cp > 1): per layer and micro-batch the attention's
      exchange of one TP rank's heads (heads/t, key/value heads kv/t), plan.context's
      cp_layer_bytes: ring cp - 1 K, V blocks forward and cp - 1 K, V, dK, dV blocks
      backward; Ulysses 8 all-to-alls; all-gather (Llama 3's) an all-gather of K, V
      forward, again backward, and a reduce-scatter of dK, dV, 3 calls. The ring's calls
      are its ring steps as the engine makes them, 3 (cp - 1) per layer (the engine's
      "ring_pass" calls: cp - 1 passing K, V forward, cp - 1 passing K, V backward and
      cp - 1 passing dK, dV home), each timed as one send, one message latency: the
      convention of Transformer Engine, which fuses K and V (and dK and dV) into one
      message per step; the engine posts the two as two messages of the same step, at
      once, and counts 6 (cp - 1) messages.
      With cp > 1 every other count moves the rank's s/cp tokens in place of s, and the
      gradients are reduced over dp x cp ranks (Megatron folds CP into the data-parallel
      group). The exchange a recomputed forward repeats is not counted.
The clipping norm's float64 (its own group in the engine) is left out: 8 bytes.

Which tensors (this project's choice, written down): GPT's are the engine's own, in the
order PipelineGPT holds them (parallel/pipeline_parallel.py): each layer's ln_1 (weight,
bias), c_attn (h x (h + 2 h_kv) and its bias, cut t ways), attn.c_proj (h x h cut t ways,
its bias whole), ln_2, mlp.c_fc (h x f and its bias, cut), mlp.c_proj (f x h cut, its bias
whole); then the ends: the token table (the vocabulary padded to a multiple of t by
plan.rules.padded_vocab, as tensor_parallel pads it; Megatron pads to 128 t) and the
position table on the first stage, the tied table's copy and ln_f on the last. A Llama
shape (swiglu) is this project's listing, there being no engine model of it: per layer
the attention norm, wq, wk, wv, wo, the MLP norm, w1, w2, w3; the token table first, the
final norm and an untied head last. Gradient buckets (Layout.bucket_bytes) are cut by
plan.rules.assign_buckets, as data_parallel cuts them, walking that order backwards; None
is one flat buffer per stage (Megatron's contiguous gradient buffer, the engine's ZeRO-1
group), 0 one message per parameter (NaiveDataParallel, what lesson 07 runs).
"""
from collections import Counter

from minidist.plan.collectives import ring_all_reduce_sent
from minidist.plan.context import cp_layer_bytes
from minidist.plan.memory import ACCOUNTING
from minidist.plan.pipeline import p2p_bytes
from minidist.plan.rules import assign_buckets, padded_vocab
from minidist.plan.traffic import dp_sent, pp_sent, tp_sent, zero_sent

LOSS_BYTES = 8            # the loss the last stage broadcasts: one float64


def layer_tensors(model, t):
    """[(elements on one TP rank, sharded)] of one layer, in the engine's order (docstring)."""
    h, f = model.hidden, model.ffn
    kv = model.kv * (h // model.heads)
    whole, cut = (h, False), lambda n: (n // t, True)
    if model.swiglu:
        return [whole, cut(h * h), cut(h * kv), cut(h * kv), cut(h * h),
                whole, cut(h * f), cut(f * h), cut(h * f)]
    qkv = h + 2 * kv
    return [whole, whole, cut(h * qkv), cut(qkv), cut(h * h), whole,
            whole, whole, cut(h * f), cut(f), cut(f * h), whole]


def end_tensors(model, t, first, last):
    """[(elements, sharded)] of a stage's ends, after its layers (docstring)."""
    h = model.hidden
    table = (padded_vocab(model.vocab, t) // t * h, True)
    if model.swiglu:
        return ([table] if first else []) + ([(h, False), table] if last else [])
    out = [table, (model.seq * h, False)] if first else []
    if last:
        out += ([] if first else [table]) + [(h, False), (h, False)]
    return out


def stage_tensors(model, t, layers, first, last):
    """[(elements, sharded)] one GPU of a stage holds: its layers', then its ends'."""
    return layer_tensors(model, t) * layers + end_tensors(model, t, first, last)


def stage_params(model, t, layers, first, last):
    """Elements one GPU of a stage holds (the sum of stage_tensors, without listing them)."""
    per_layer = sum(n for n, _ in layer_tensors(model, t))
    return layers * per_layer + sum(n for n, _ in end_tensors(model, t, first, last))


def _sizes(per_layer, ends, layers):
    """A thunk: the stage's tensor sizes in order, listed only when buckets need them."""
    return lambda: [n for n, _ in per_layer * layers + ends]


def _buckets(sizes, itemsize, bucket_bytes, total):
    """Elements per gradient bucket: one flat buffer of `total` (None), one per parameter
    (0), or assign_buckets' cut (data_parallel's) of the parameters' bytes; sizes: a thunk."""
    if bucket_bytes is None:
        return [total]
    sizes = sizes()
    if bucket_bytes == 0:
        return list(sizes)
    cut = assign_buckets([n * itemsize for n in sizes], bucket_bytes)
    return [sum(sizes[i] for i in b) for b in cut]


def _zero_calls(stage, n_groups, m, reshard=True):
    """(reduce-scatter calls, all-gather calls) per step of zero_sent's schedule."""
    if stage == 1:
        return n_groups, n_groups
    if stage == 2:
        return m * n_groups, n_groups
    return m * n_groups, m * (2 * n_groups - 1 if reshard else n_groups)


def _each_size(sizes, count):
    """sum(count(n) for n in sizes), counting each distinct size once (a ring's count is
    linear in its messages; chunk_bounds costs O(N) each, and a search makes many)."""
    return sum(k * count(n) for n, k in Counter(sizes).items())


def _zero_rows(stage, groups, d, rank, m, g_item, w_item):
    """{"reduce_scatter", "all_gather": (calls, bytes)} of zero_sent over `groups` (stage
    3: the root unit first), from each distinct group's count (zero_sent is linear in its
    groups; at stage 3 a group after the first is gathered again for backward)."""
    def one(n, root):
        pair = [(n, g_item, w_item)] if root else [(0, g_item, w_item), (n, g_item, w_item)]
        return zero_sent(stage, pair, d, rank, m)
    rs = ag = 0
    for n, k in Counter(groups[1:]).items():
        row = one(n, stage < 3)
        rs, ag = rs + k * row["reduce_scatter"], ag + k * row["all_gather"]
    row = one(groups[0], True)
    rs, ag = rs + row["reduce_scatter"], ag + row["all_gather"]
    calls = _zero_calls(stage, len(groups), m)
    return {"reduce_scatter": (calls[0], rs), "all_gather": (calls[1], ag)}


# per layer and micro-batch: (the collective's name, calls) of each CP variant (docstring;
# the ring: 3 (cp - 1) steps, forward K, V, backward K, V and dK, dV, one latency each)
CP_CALLS = {"ring": lambda cp: ("send", 3 * (cp - 1)), "ulysses": lambda cp: ("all_to_all", 8),
            "allgather": lambda cp: ("all_gather+reduce_scatter", 3)}


def cp_layer(model, layout):
    """Bytes one GPU's attention exchange sends per layer and micro-batch, forward and
    backward: plan.context.cp_layer_bytes of its TP rank's heads (0 when cp = 1)."""
    if layout.cp == 1:
        return 0
    t, hd = layout.tp, model.hidden // model.heads
    return cp_layer_bytes(layout.cp_variant, layout.micro_batch, model.seq, model.heads // t, hd,
                          layout.cp, ACCOUNTING[layout.precision][0], model.kv // t)


def rank_sent(model, layout, layers, pp_rank=0, tp_rank=0, dp_rank=0, scatter_gather=False):
    """{"tp", "pp", "dp"} (and "cp" when cp > 1): {collective: (calls, bytes)} that GPU (pp_rank, tp_rank,
    dp_rank) sends in one step; layers: its stage's layers (layout.stage_layers);
    scatter_gather: its pipeline neighbours are in another node (module docstring);
    dp_rank: its rank in the dp x cp group that reduces the gradients."""
    t, p, d, b, v = layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.chunks
    cp = layout.cp
    s, h = model.seq // cp, model.hidden                 # this rank's tokens of each sequence
    m = model.global_batch // (d * b)
    w_item, g_item, _ = ACCOUNTING[layout.precision]
    first, last = pp_rank == 0, pp_rank == p - 1
    per_layer, ends = layer_tensors(model, t), end_tensors(model, t, first, last)
    layer_n, ends_n = sum(n for n, _ in per_layer), sum(n for n, _ in ends)
    psi = layers * layer_n + ends_n
    out = {"tp": {}, "pp": {}, "dp": {}}
    if cp > 1:                                           # a "cp" group only where there is one
        name, calls = CP_CALLS[layout.cp_variant](cp)
        out["cp"] = {}
        out["cp"][name] = (layers * m * calls, layers * m * cp_layer(model, layout))
    d *= cp                                              # the gradients' group: dp x cp
    if t > 1:
        whole = sum(k * n for k, part in ((layers, per_layer), (1, ends))
                    for n, sharded in part if not sharded)
        again = layers if layout.recompute == "full" else 0
        out["tp"] = tp_sent(b, s, h, layers, t, tp_rank, w_item, m, first, last,
                            layout.sequence_parallel, True, whole, False, again)
    if p > 1:
        stages = [pp_rank + c * p for c in range(v)]
        per = h // t if scatter_gather else h
        out["pp"]["send"] = (m * sum((c < p * v - 1) + (c > 0) for c in stages),
                             pp_sent(stages, p * v, [b] * m, s, per, w_item))
        if last:
            out["pp"]["broadcast"] = (1, LOSS_BYTES * (p - 1))
        if (first or last) and not model.swiglu:        # GPT's tied table: its two copies summed
            table = padded_vocab(model.vocab, t) // t * h
            out["pp"]["all_reduce"] = (1, ring_all_reduce_sent(table, 2, int(last)) * g_item)
    if d > 1:
        sizes = _sizes(per_layer, ends, layers)
        if layout.zero == 0:
            buckets = _buckets(sizes, w_item, layout.bucket_bytes, psi)
            each = _each_size(buckets, lambda n: dp_sent([n], d, dp_rank, g_item)[1])
            out["dp"]["all_reduce"] = (len(buckets), each)
        else:
            if layout.zero == 1:
                groups = [psi]
            elif layout.zero == 2:
                groups = _buckets(sizes, w_item, layout.bucket_bytes, psi)
            else:                                       # the ends (root unit), then each layer
                groups = [ends_n] + [layer_n] * layers
            k = (layout.accumulate or 1) if layout.zero == 2 else 1   # reduce-scatters: m / k
            out["dp"] = _zero_rows(layout.zero, groups, d, dp_rank, m // k, g_item, w_item)
    return {g: {k: c for k, c in row.items() if c[1]} for g, row in out.items()}


def totals(row):
    """Bytes of a {collective: (calls, bytes)} row."""
    return sum(nbytes for _, nbytes in row.values())


def seconds(row, size, alpha, bandwidth, sizes=None):
    """Alpha-beta time of a {collective: (calls, bytes)} row on one link: each call's
    message steps (a ring all-reduce 2(N-1), a reduce-scatter, all-gather or a root's
    broadcast N-1, a send 1) x alpha, plus the bytes / bandwidth (plan.collectives' ring
    times, from the bytes counted chunk by chunk). sizes: {collective: N} where a row's
    collectives span other groups than `size` ranks (the pipeline's)."""
    total = 0.0
    for name, (calls, nbytes) in row.items():
        n = (sizes or {}).get(name, size)
        steps = 1 if name == "send" else (2 if name == "all_reduce" else 1) * (n - 1)
        total += calls * steps * alpha + nbytes / bandwidth
    return total


def transfer_bytes(model, layout, scatter_gather=False):
    """One point-to-point transfer: b (s/cp) h (h/t each under scatter/gather) in the
    activations' itemsize (plan.pipeline.p2p_bytes)."""
    h = model.hidden // layout.tp if scatter_gather else model.hidden
    return p2p_bytes(layout.micro_batch, model.seq // layout.cp, h, ACCOUNTING[layout.precision][0])
