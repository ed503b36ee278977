"""Tensor parallelism's accounting read off a model: the shapes of a TensorParallelGPT
handed to the counts in minidist/plan (plan.traffic.tp_sent for training,
tp_generation_sent for generation, plan.memory for activation memory, which lesson 03
prints beside its measurements and the tests hold the measurements to), and the
activation meter's reading. The formulas themselves live once, in minidist/plan, as
functions of plain numbers, so that the planner counts a cluster with the very same code.

    python -c "from minidist.plan.memory import korthikanti_layer_bytes as k; print(k(2048, 1, 12288, 96, 8))"
"""
import numpy as np

from minidist.plan.traffic import dp_sent, tp_generation_sent, tp_sent
from minidist.tensor import MEMORY

# ----------------------------------------------------------------------------- bytes, from the model's shapes


def expected_bytes(model, batch, T, micro_batches=1, clip=True, dp_comm=None, recomputed_layers=0, stage=None):
    """{collective: (calls, bytes)} this rank sends in one training step: plan.traffic.tp_sent
    (the count, collective by collective) of this model's shapes, plus, with a
    data-parallel group (NaiveDataParallel), one ring all-reduce per parameter shard.

    recomputed_layers: layers whose forward runs again in backward (activation
    recomputation, minidist/recompute.py: L for full and every-k, 0 for selective).
    stage: the pipeline stage this rank runs (pipeline_parallel.PipelineGPT over this
    model, 3D parallelism): only its layers communicate, the embedding's g on the first
    stage, the head's f and the loss's 3 on the last; only its parameters are averaged.
    """
    cfg = model.config
    L, first, last, params = cfg.n_layer, True, True, model.parameters()
    if stage is not None:
        L = sum(hi - lo for lo, hi in (stage.ranges[s] for s in stage.stages))
        first, last, params = stage.first, stage.last, stage.parameters()
    out = tp_sent(batch, T, cfg.n_embd, L, model.tp, model.tp_rank, np.dtype(cfg.dtype).itemsize,
                  micro_batches, first, last, model.sequence_parallel, not model.sp_keep_gathered,
                  replicated_elements(model), clip, recomputed_layers)
    if dp_comm is not None and dp_comm.Get_size() > 1:
        calls, sent = dp_all_reduce_bytes(params, dp_comm)
        c, b = out.get("all_reduce", (0, 0))
        out["all_reduce"] = (c + calls, b + sent)
    return out


def replicated_elements(model):
    """Elements of the parameters tensor parallelism keeps whole on every rank (layer norms,
    the position table, the row-parallel biases): what sequence parallelism all-reduces."""
    return sum(p.size for n, p in model.named_parameters() if n not in model.specs)


def dp_all_reduce_bytes(params, dp_comm):
    """(calls, bytes) this rank sends averaging `params`' gradients over the replicas of
    dp_comm as NaiveDataParallel does: plan.traffic.dp_sent of their sizes."""
    return dp_sent([p.size for p in params], dp_comm.Get_size(), dp_comm.Get_rank(),
                   [p.data.itemsize for p in params])


def generation_bytes(model, batch, positions):
    """{"all_reduce": (calls, bytes)} this rank sends for one step of generation that feeds
    `positions` new tokens of `batch` sequences: plan.traffic.tp_generation_sent."""
    cfg = model.config
    return tp_generation_sent(batch, positions, cfg.n_embd, cfg.n_layer, model.tp, model.tp_rank,
                              np.dtype(cfg.dtype).itemsize)


def generation_feeds(prompt, n, block_size):
    """How many positions each of minidist.model.generate_greedy's n steps feeds: the
    prompt, then one token a step while the sequence fits in block_size, then the
    cropped window of block_size (positions shift, nothing cached is valid)."""
    out, length = [], prompt
    for step in range(n):
        out.append(prompt if step == 0 else (1 if length <= block_size else block_size))
        length += 1
    return out

# ----------------------------------------------------------------------------- activation memory, measured


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
