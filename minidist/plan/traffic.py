"""Bytes each rank sends per training step, by strategy and collective, from shapes alone.

Two kinds of function, both of plain numbers (shapes, world sizes, ranks, itemsizes):
- *_bytes: the papers' counts, the ring's (N-1)/N with even chunks, for any scale;
- *_sent: exactly what this engine's ranks send, chunk by chunk (numpy.array_split's
  uneven chunks included, plan.collectives). The lessons' counters must equal these to
  the byte (tests/mpi/test_tensor_parallel.py, test_zero.py, test_fsdp.py,
  test_pipeline_parallel.py, test_3d_parallel.py), and at shapes the ranks divide they
  equal the *_bytes (tests/test_plan_formulas.py): one count from 8 ranks to a cluster.

The papers' counts (docs/reference.md):
    DP, ring all-reduce of the gradients          2 (N-1)/N Psi
    TP, per layer (Megatron's f and g, fwd+bwd)   4 all-reduces of b s h: 8 b s h (t-1)/t
        with sequence parallelism                 4 all-gathers + 4 reduce-scatters: the same
    ZeRO 1, 2 (Rajbhandari et al. 2020, sec. 7)   reduce-scatter + all-gather: 2 (N-1)/N Psi
    ZeRO 3                                        two all-gathers + a reduce-scatter: 3 (N-1)/N Psi
    PP, per boundary, micro-batch and direction   b s h (plan.pipeline.p2p_bytes)
    MoE, per layer (even routing)                 4 all-to-alls of (ep-1)/ep x tokens k h

Compressed data parallelism (minidist/parallel/compression.py), exactly: ring_bytes in the
wire's dtype (fp16), two_phase_sent of the coded chunks (int8, 1 bit), onebit_adam_sent,
powersgd_sent, and compressed_run_sent over a run with its uncompressed warm-up.
"""
from collections import Counter

from minidist.plan.collectives import (ring_all_gather_sent, ring_all_reduce_sent,
                                       ring_reduce_scatter_sent)
from minidist.plan.pipeline import p2p_bytes
from minidist.plan.rules import chunk_bounds

# ----------------------------------------------------------------------------- the papers' counts


def dp_bytes(n_params, n_d, itemsize):
    """Bytes per rank of a ring all-reduce of the gradients: 2 (N-1)/N Psi itemsize."""
    return 2 * (n_d - 1) * n_params * itemsize / n_d


def tp_layer_elements(b, s, h, t, regather=False):
    """Elements per rank per layer, forward and backward: 4 ring all-reduces of b s h (2 in
    forward, 2 in backward; Shoeybi et al. 2019, Figure 4), or under sequence parallelism
    4 all-gathers and 4 reduce-scatters of it (Korthikanti et al. 2022, section 4.2.2):
    8 b s h (t-1)/t either way. regather (sequence parallelism only; TensorParallelGPT's
    default, this engine's choice): c_attn and c_fc gather their input again in backward
    instead of keeping it, 2 more all-gathers, 10 b s h (t-1)/t. An integer where t divides
    b s h (floored otherwise; tp_sent counts uneven chunks exactly)."""
    return (10 if regather else 8) * b * s * h * (t - 1) // t


def tp_layer_bytes(b, s, h, t, itemsize, sequence_parallel=False, regather=False):
    """Bytes per rank per layer, tp_layer_elements' count x itemsize, not floored:
    8 b s h (t-1)/t itemsize (10 with sequence parallelism's regather)."""
    n = 10 if regather and sequence_parallel else 8
    return n * b * s * h * (t - 1) * itemsize / t


def zero_bytes(stage, psi, n_d, itemsize, micro_batches=1, root=0, reshard=True):
    """The ZeRO paper's count, bytes per rank per step: (N-1)/N x (2 Psi for stages 0-2,
    3 Psi for stage 3, less the root unit's backward gather `root` this code never makes;
    2 Psi without resharding after forward: nothing is gathered twice). Stage 2 and 3
    reduce the gradients once per micro-batch, stage 1 once per step."""
    f = (n_d - 1) / n_d * itemsize
    if stage == 0:
        return f * 2 * psi
    if stage == 3:
        return f * micro_batches * ((3 * psi - root) if reshard else 2 * psi)
    return f * ((psi if stage == 1 else micro_batches * psi) + psi)


def moe_bytes(tokens, top_k, h, ep, itemsize):
    """Bytes per rank per MoE layer per step of expert parallelism under even routing:
    4 all-to-alls (dispatch and combine, forward and backward; Lepikhin et al. 2020,
    GShard), each sending the (ep-1)/ep of its tokens x top_k rows of h that leave it."""
    return 4 * (ep - 1) / ep * tokens * top_k * h * itemsize


# ----------------------------------------------------------------------------- this engine, exactly


def dp_sent(sizes, n_d, rank, itemsize):
    """(calls, bytes) rank sends averaging gradients as NaiveDataParallel does: one ring
    all-reduce per parameter of `sizes` elements; itemsize one number or one per size."""
    items = itemsize if isinstance(itemsize, (list, tuple)) else [itemsize] * len(sizes)
    return len(sizes), sum(ring_all_reduce_sent(n, n_d, rank) * i for n, i in zip(sizes, items))


def tp_sent(batch, s, h, layers, t, rank, itemsize, micro_batches=1, first=True, last=True,
            sequence_parallel=False, regather=True, replicated=0, clip=True, recomputed_layers=0):
    """{collective: (calls, bytes)} rank `rank` of t sends in one step of tensor-parallel
    training (TensorParallelGPT), `layers` of its blocks, micro-batches of `batch` rows of s
    tokens, hidden size h:
    - plain TP: all-reduces of b s h: 2 per layer forward (g) and 2 backward (f), one for
      the embedding (g, first stage) and one for the head's input (f, last stage); 3 of
      b s for the loss (last stage);
    - sequence parallel: those all-reduces become as many all-gathers plus as many
      reduce-scatters along the sequence; the loss keeps its 3 all-reduces; with regather
      (TensorParallelGPT's default) c_attn and c_fc all-gather their input again in
      backward: 2 more all-gathers per layer; once per step, one all-reduce of the
      `replicated` elements' gradients (layer norms, position table, row biases);
    - recomputed_layers: layers whose forward runs again in backward (full or every-k
      recomputation; selective reruns no collective): 2 more g's each per micro-batch;
    - clip: one all-reduce of one float64 (the squared norm of the shards).
    """
    k, item = micro_batches, itemsize
    n_big = 4 * layers + first + last + 2 * recomputed_layers
    out = {"all_reduce": [0, 0], "all_gather": [0, 0], "reduce_scatter": [0, 0]}

    def add(name, calls, elements, size=item):
        out[name][0] += calls
        out[name][1] += elements * size

    if sequence_parallel:
        n_ag = n_big + (2 * layers if regather else 0)
        add("all_gather", k * n_ag, k * n_ag * ring_all_gather_sent(s, batch * h, t, rank))
        rs = ring_reduce_scatter_sent(s, batch * h, t, rank)
        add("reduce_scatter", k * n_big, k * n_big * rs)
        add("all_reduce", 1, ring_all_reduce_sent(replicated, t, rank))
    else:
        add("all_reduce", k * n_big, k * n_big * ring_all_reduce_sent(batch * s * h, t, rank))
    if last:
        add("all_reduce", 3 * k, 3 * k * ring_all_reduce_sent(batch * s, t, rank))
    if clip:
        add("all_reduce", 1, ring_all_reduce_sent(1, t, rank), size=8)
    return {name: tuple(v) for name, v in out.items() if v[0]}


def tp_generation_sent(batch, positions, h, layers, t, rank, itemsize):
    """{"all_reduce": (calls, bytes)} rank sends in one step of tensor-parallel generation
    feeding `positions` new tokens of `batch` sequences: g after the embedding and after
    each layer's attention and MLP (2L + 1 all-reduces of b positions h), then the two of
    b numbers of vocab_parallel_argmax (the logits' dtype, then int64 ids)."""
    n = 2 * layers + 1
    sent = n * ring_all_reduce_sent(batch * positions * h, t, rank) * itemsize
    sent += ring_all_reduce_sent(batch, t, rank) * (itemsize + 8)
    return {"all_reduce": (n + 2, sent)}


def zero_sent(stage, groups, n_d, rank, micro_batches=1, reshard=True):
    """{collective: bytes} rank sends per step under this engine's ZeRO (parallel/zero.py).

    groups: [(elements, reduce itemsize, gather itemsize)], one per flat buffer (stage 1:
    one; stage 2: the buckets; stage 3: the units, the root unit first). Gradients travel
    in the reduce dtype (16 bits when lesson 10 asks), weights in theirs.
    Stage 1: one reduce-scatter and one all-gather of every group per step. Stage 2: a
    reduce-scatter per micro-batch (the full gradient is never kept), one all-gather.
    Stage 3: per micro-batch, every unit gathered for forward, the blocks again for
    backward (when resharded; the root unit stays), every unit reduce-scattered."""
    rs = sum(ring_reduce_scatter_sent(n, 1, n_d, rank) * r for n, r, _ in groups)
    ag = [ring_all_gather_sent(n, 1, n_d, rank) * g for n, _, g in groups]
    k = 1 if stage == 1 else micro_batches
    if stage < 3:
        return {"reduce_scatter": k * rs, "all_gather": sum(ag)}
    return {"reduce_scatter": k * rs, "all_gather": k * (sum(ag) + (sum(ag[1:]) if reshard else 0))}


def moe_sent(rows_out, rows_in, h, itemsize):
    """Bytes rank sends in one MoE layer's four all-to-alls (parallel/expert_parallel.py),
    from the routing: dispatch forward and combine backward carry the rows_out it sends to
    other ranks' experts, combine forward and dispatch backward the rows_in other ranks
    send to its experts: 2 (rows_out + rows_in) h itemsize."""
    return 2 * (rows_out + rows_in) * h * itemsize


def moe_padded_sent(n_expert, capacity, h, ep, itemsize):
    """Bytes a rank sends in ONE all-to-all of the padded (E, capacity, h) buffer (GShard;
    DeepSpeed-MoE; Megatron-Core's --moe-pad-expert-input-to-capacity): the (ep-1)/ep of
    it bound for other ranks' experts, (ep-1)/ep x E x capacity x h x itemsize, whatever
    the routing. Four per MoE layer per step (dispatch and combine, forward and backward)."""
    return (ep - 1) * (n_expert // ep) * capacity * h * itemsize


def pp_sent(stages, n_virtual, batch_rows, s, h, itemsize):
    """Bytes rank sends point-to-point in one pipeline step: b s h per micro-batch (rows b
    of `batch_rows`) per boundary, forward from each of its virtual `stages` that is not
    the last of n_virtual, backward from each that is not the first."""
    per_mb = sum(k * p2p_bytes(b, s, h, itemsize) for b, k in Counter(batch_rows).items())  # m can be 1000s
    return sum(per_mb * ((v < n_virtual - 1) + (v > 0)) for v in stages)


def clip_sent(sizes_and_ranks):
    """Bytes of the gradient norm's float64 summed over each (size, rank) group > 1."""
    return sum(ring_all_reduce_sent(1, n, r) * 8 for n, r in sizes_and_ranks if n > 1)


def parallel_3d_sent(b, s, h, m, itemsize, tp, pp, dp, layers, first=True, last=True, stages=(0,),
                     n_virtual=1, wte_elements=0, dp_sizes=(), zero_groups=None, zero_stage=1,
                     recomputed_layers=0, sequence_parallel=False, regather=True, replicated=0,
                     clip=True):
    """{group: {collective: bytes}} rank sends in one step of 3D parallelism
    (parallel/parallel_3d.py), tp, pp, dp its (size, rank) in each group; m micro-batches
    of b rows; `layers` of its stage's blocks, its virtual `stages` of n_virtual.
    - tp: tp_sent of its layers and ends (no clipping there: "clip" is its own group);
    - pp: pp_sent; the loss, one float64 from the last stage to each other; the tied
      embedding's gradient (wte_elements), a ring all-reduce of two ranks between the
      first and the last stage;
    - dp: zero_sent of zero_groups (ZeRO, stage 1 in lesson 07), or dp_sent of dp_sizes;
    - clip: the squared norm's float64, all-reduced over tp, then pp."""
    (t, t_rank), (p, p_rank), (d, d_rank) = tp, pp, dp
    out = {"tp": {k: v[1] for k, v in tp_sent(b, s, h, layers, t, t_rank, itemsize, m, first, last,
                                              sequence_parallel, regather, replicated, False,
                                              recomputed_layers).items()},
           "pp": {}, "dp": {}, "clip": {}}
    if p > 1:
        out["pp"]["send"] = pp_sent(stages, n_virtual, [b] * m, s, h, itemsize)
        if last:
            out["pp"]["broadcast"] = 8 * (p - 1)
        if first or last:
            out["pp"]["all_reduce"] = ring_all_reduce_sent(wte_elements, 2, int(last)) * itemsize
    if zero_groups is not None:
        out["dp"] = zero_sent(zero_stage, zero_groups, d, d_rank, m)
    elif d > 1:
        out["dp"]["all_reduce"] = dp_sent(dp_sizes, d, d_rank, itemsize)[1]
    if clip:
        out["clip"]["all_reduce"] = clip_sent([tp, pp])
    return {g: {k: v for k, v in row.items() if v} for g, row in out.items()}


# ----------------------------------------------------------------------------- gradient compression
# (minidist/parallel/compression.py; the strategy calls these with its own numbers)


def ring_bytes(n, size, rank, itemsize):
    """Bytes `rank` sends in a ring all-reduce of n items of `itemsize` bytes."""
    return ring_all_reduce_sent(n, size, rank) * itemsize


def code_bytes(n, bits):
    """Bytes of n values coded in `bits` bits each, rounded up: n for int8, ceil(n / 8) for 1 bit."""
    return -(-n * bits // 8)


def message_bytes(segments, itemsize, bits):
    """Bytes of one chunk's message in the two-phase exchange: per segment (its length in
    `segments`) one scale of `itemsize` bytes and its payload, code_bytes(length, bits)."""
    return sum(itemsize + code_bytes(m, bits) for m in segments)


def two_phase_sent(messages, rank):
    """Bytes `rank` sends in the two-phase exchange (1-bit Adam's compressed_allreduce, Tang
    et al. 2021) of chunks whose messages are `messages` bytes (one per rank): phase 1 (an
    all-to-all) sends every chunk but the rank's own, phase 2 (a ring all-gather) every one
    but its right neighbour's: about 2 (N-1)/N x (the compressed size)."""
    n_d = len(messages)
    if n_d == 1:
        return 0
    return 2 * sum(messages) - messages[rank] - messages[(rank + 1) % n_d]


def onebit_adam_sent(n, n_d, rank, itemsize):
    """Bytes `rank` sends in one compressed step of 1-bit Adam (Tang et al. 2021; DeepSpeed's
    compressed_allreduce) over n momentum values: the flat vector cut into n_d chunks
    (numpy.array_split's sizes), chunk j's message = one scale (itemsize bytes) + its signs
    packed 8 per byte, ceil(c_j / 8); two_phase_sent of those: about
    2 (n_d-1)/n_d x (n/8 + itemsize), 1/32 of fp32's 2 (n_d-1)/n_d x 4n."""
    b = chunk_bounds(n, n_d)
    return two_phase_sent([message_bytes([b[j + 1] - b[j]], itemsize, 1) for j in range(n_d)], rank)


def powersgd_sent(matrices, vector_elements, n_d, rank, itemsize):
    """Bytes `rank` sends in one PowerSGD step (Vogels et al. 2019): matrices [(n, m, r)],
    all P's (n x r) in one ring all-reduce, all Q's (m x r) in another, the vectors'
    `vector_elements` uncompressed in a third."""
    p = sum(n * r for n, _, r in matrices)
    q = sum(m * r for _, m, r in matrices)
    return sum(ring_bytes(c, n_d, rank, itemsize) for c in (p, q, vector_elements))


def compressed_run_sent(steps, warmup_steps, uncompressed, compressed):
    """Bytes over `steps` steps from the start: the warm-up's uncompressed steps, then
    compressed ones. Over a long run with warm-up fraction w, 1 bit sends
    1/(w + (1-w)/32) times less than fp32."""
    w = min(steps, warmup_steps)
    return w * uncompressed + (steps - w) * compressed
