"""The GPT cut across a tensor-parallel group (minidist/parallel/tensor_parallel.py has its
layers): which parameter is cut how, the model built from the whole one, gathering the
shards back, and the training step's slot (gradient sync and the global norm for clipping).
Over 400 lines but one idea: the cut (shard_specs), the build, the gather and the sync
must agree on every parameter, so they are read side by side.

    mpirun -n 8 python -m minidist.lessons.03_tensor_parallel --generate 32

Every rank builds the same single-process GPT from the seed and hands it to
`TensorParallelGPT`, which keeps this rank's shards (`shard_specs`) and the replicated
rest (layer norms, position table, row-parallel biases) under the same names; a
parameter that silently stayed whole is an error (`check_sharded`). `gather_state`
puts the shards back together under the single-process names, padding removed, so a
lesson compares every tensor whole. Memory: 1/t of the matrices and the token table per
rank, plus the replicated rest.

Generation: `minidist.model.generate_greedy` drives this model as it drives the GPT.
Each rank keeps the keys and values of its own heads (a KV cache of 1/t the size); a
new token costs 2 all-reduces of b*h per layer, one for the embedding, and the two of
b numbers that pick the token from the vocabulary-split logits.

Mixture of experts (minidist/moe.py, with expert parallelism):
a block whose MLP is an MoEMLP keeps that MLP whole, not cut: plain tensor parallelism
leaves ln_2's output whole on every rank of the group, so the router and the experts
act on the same replicated activations there, every TP rank computes the same routing
and the same expert outputs, and the MoE output joins the residual stream with no f or
g around it. Its parameters (router, stacked experts) are replicated over the group
like the layer norms, and each TP rank's gradient of them is already whole: nothing
over the group may sum them. The loss adds the MoE auxiliary losses (balance, z) as
GPT.forward does, the same number on every TP rank. Spread over ranks, the experts go
to an ep group carved out of the data-parallel ranks, one per TP rank:

    grid = ProcessGrid(tp=2)                                # dp = world / 2
    model = TensorParallelGPT(GPT(cfg_with_moe_groups_dp), grid.tp_comm)
    ep = expert_parallel(model, grid.dp_comm, grid.dp_comm) # ep = dp: tp rank i's ep group i
    sync = TensorParallelSync(model, dp=ep)                 # train_step's dp slot

(minidist/parallel/expert_parallel.py says why the TP pair's all-to-alls are redundant
and how the gradients and the clipping norm are counted.) Sequence parallelism with
MoE is refused: each rank would route only its slice of the sequence.
"""

import numpy as np

from minidist import ops, recompute
from minidist.backend import on_device, to_device, to_numpy, xp
from minidist.model import GPT, KVCache, check_positions
from minidist.moe import MoEMLP
from minidist.nn import Module, ModuleDict, ModuleList, Parameter
from minidist.optim import grad_norm_sq
from minidist.parallel.sequence_parallel import sequence_bounds
from minidist.parallel import tensor_parallel
from minidist.parallel.strategy import Strategy
from minidist.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, SlicedRNG,
                                               enter_region, leave_region, padded_vocab, sequence_dropout,
                                               split_for_rank, vocab_parallel_argmax, vocab_parallel_cross_entropy,
                                               vocab_parallel_embedding, vocab_range)
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor

# ----------------------------------------------------------------------------- how each weight is cut


class Shard:
    """How one parameter is cut: along `axis`, in `blocks` equal blocks that are each cut
    in t pieces (c_attn's columns are q | k | v: rank r takes its heads from each block),
    after padding the axis from `size` to `padded` with zeros (the vocabulary)."""

    def __init__(self, axis, blocks=1, size=None, padded=None):
        self.axis, self.blocks, self.size, self.padded = axis, blocks, size, padded

    def __repr__(self):
        pad = f", padded {self.size}->{self.padded}" if self.padded != self.size else ""
        return f"Shard(axis={self.axis}, blocks={self.blocks}{pad})"


def shard_specs(config, t):
    """{name: Shard} for every sharded parameter of the GPT; the others are replicated.
    An MoE block's MLP (router and experts) is not cut: replicated over the group."""
    V = config.vocab_size
    specs = {"transformer.wte.weight": Shard(0, size=V, padded=padded_vocab(V, t))}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        moe = config.is_moe(i)
        specs[h + "attn.c_attn.weight"] = Shard(1, blocks=3)        # column-parallel, q|k|v
        specs[h + "attn.c_proj.weight"] = Shard(0)                  # row-parallel
        if not moe:
            specs[h + "mlp.c_fc.weight"] = Shard(1)                 # column-parallel
            specs[h + "mlp.c_proj.weight"] = Shard(0)               # row-parallel
        if config.bias:
            specs[h + "attn.c_attn.bias"] = Shard(0, blocks=3)
            if not moe:
                specs[h + "mlp.c_fc.bias"] = Shard(0)
    return specs


def kind_of(a):
    """The array module `a` is made with: the device's for a device array (the model's
    weights), NumPy for a host one (the pieces gathered home for comparing)."""
    return xp if on_device(a) else np


def shard(full, spec, rank, t):
    """This rank's piece of a whole array (a copy, of the same kind: device or host);
    `spec` None means replicated."""
    if spec is None:
        return full.copy()
    ns = kind_of(full)
    if spec.padded is not None and spec.padded != full.shape[spec.axis]:
        widths = [(0, 0)] * full.ndim
        widths[spec.axis] = (0, spec.padded - full.shape[spec.axis])
        full = ns.pad(full, widths)
    blocks = ns.split(full, spec.blocks, axis=spec.axis)
    return ns.concatenate([split_for_rank(b, spec.axis, rank, t) for b in blocks], axis=spec.axis)


def unshard(pieces, spec):
    """The whole array from every rank's piece (in rank order, all of one kind: device or
    host), padding removed."""
    if spec is None:
        return pieces[0]
    ns = kind_of(pieces[0])
    per_rank = [ns.split(p, spec.blocks, axis=spec.axis) for p in pieces]
    whole = ns.concatenate([ns.concatenate([pr[b] for pr in per_rank], axis=spec.axis)
                            for b in range(spec.blocks)], axis=spec.axis)
    if spec.size is not None:
        index = [slice(None)] * whole.ndim
        index[spec.axis] = slice(0, spec.size)
        whole = whole[tuple(index)].copy()
    return whole


def shard_shape(shape, spec, t):
    if spec is None:
        return tuple(shape)
    out = list(shape)
    out[spec.axis] = (spec.padded or shape[spec.axis]) // t
    return tuple(out)

# ----------------------------------------------------------------------------- the model


class TPError(ValueError):
    """A model that cannot be cut t ways (found alike on every rank)."""


class ParallelAttention(Module):
    """nanoGPT's CausalSelfAttention with this rank's n_head / t heads."""

    def __init__(self, full, take, comm, keep_gathered=False):
        self.c_attn = ColumnParallelLinear(take("c_attn.weight"), take("c_attn.bias"), comm, keep_gathered)
        self.c_proj = RowParallelLinear(take("c_proj.weight"), take("c_proj.bias"), comm)
        self.n_head, self.dropout = full.n_head, full.dropout
        self.t, self.rank = comm.Get_size(), comm.Get_rank()
        self.recompute_core = False                                    # selective recomputation
        self.core = getattr(full, "core", None)                        # the GPT's attention core

    def forward(self, x, rng, seq=None, cache=None):
        sp = seq is not None                                           # seq: (T, lo, hi) under SP
        qkv = self.c_attn(x, sp)                                       # (B, T, 3C/t)
        B, T, C3 = qkv.shape
        nh, c = self.n_head // self.t, C3 // 3                         # my heads, my channels
        q, k, v = ops.split(qkv, c, axis=2)                            # 3 x (B, T, C/t)
        q = q.reshape(B, T, nh, c // nh).transpose(1, 2)               # (B, nh/t, T, hs)
        k = k.reshape(B, T, nh, c // nh).transpose(1, 2)
        v = v.reshape(B, T, nh, c // nh).transpose(1, 2)
        if cache is not None:                                          # generation: my heads' k, v
            y = Tensor(cache.attend(q.data, k.data, v.data))           # (B, nh/t, T, hs)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, c))     # (B, T, C), summed by g
        p = self.dropout if self.training else 0.0
        if self.core is not None:      # my heads start at rank * nh: the raw rng (masks by position)
            y = self.core(q, k, v, p, rng, self.rank * nh)             # (B, nh/t, T, hs)
        else:
            heads = slice(self.rank * nh, (self.rank + 1) * nh)
            att_rng = SlicedRNG(rng, (B, self.n_head, T, T), (slice(None), heads)) if p > 0 else None
            y = recompute.attention_core(q, k, v, p, att_rng, self.recompute_core)   # (B, nh/t, T, hs)
        y = y.transpose(1, 2).reshape(B, T, c)                         # (B, T, C/t)
        return sequence_dropout(self.c_proj(y, sp), p, rng, seq)       # (B, T or T_r, C)


class ParallelMLP(Module):
    def __init__(self, full, take, comm, keep_gathered=False):
        self.c_fc = ColumnParallelLinear(take("c_fc.weight"), take("c_fc.bias"), comm, keep_gathered)
        self.c_proj = RowParallelLinear(take("c_proj.weight"), take("c_proj.bias"), comm)
        self.p = full.dropout.p
        self.gelu = full.gelu                                          # "tanh" or "erf", as the model's

    def forward(self, x, rng, seq=None):
        sp = seq is not None
        h = ops.gelu(self.c_fc(x, sp), self.gelu)                       # (B, T, 4C/t), local GELU
        return sequence_dropout(self.c_proj(h, sp), self.p if self.training else 0.0, rng, seq)


class ParallelBlock(Module):
    def __init__(self, full, take, comm, keep_gathered=False):
        self.ln_1 = full.ln_1                                          # replicated
        self.attn = ParallelAttention(full.attn, lambda n: take("attn." + n), comm, keep_gathered)
        self.ln_2 = full.ln_2
        self.moe = isinstance(full.mlp, MoEMLP)
        if self.moe:      # whole, replicated: router and experts see ln_2's whole output
            self.mlp = full.mlp
        else:
            self.mlp = ParallelMLP(full.mlp, lambda n: take("mlp." + n), comm, keep_gathered)

    def forward(self, x, rng, seq=None, cache=None):
        x = x + self.attn(self.ln_1(x), rng, seq, cache)
        if self.moe:      # (an MoEMLP or its ExpertParallelMoE: whole output, no f or g)
            x = x + self.mlp(self.ln_2(x), rng)
        else:
            x = x + self.mlp(self.ln_2(x), rng, seq)
        return x


class VocabParallelEmbedding(Module):
    def __init__(self, weight, lo):
        self.weight, self.lo = weight, lo

    def forward(self, idx):
        return vocab_parallel_embedding(idx, self.weight, self.lo)


class TensorParallelGPT(Module):
    """The GPT cut across the ranks of `comm` (a tensor-parallel group), from the whole one.

    Every rank builds the same single-process GPT from the seed and hands it here; each
    keeps its shards (`shard_specs`) and the replicated rest, under the same names.
    forward returns this rank's vocabulary columns of the logits and the whole loss.
    sp_keep_gathered: under sequence parallelism, c_attn and c_fc save the gathered
    input (no re-gather in backward) instead of this rank's slice (sequence_parallel.py).
    """

    @property
    def tensor_parallel(self):
        """Itself: a model that says how its parameters are sharded (specs, full_shapes,
        tp_rank, tp), for a checkpoint (minidist/checkpoint/layouts.py)."""
        return self

    def __init__(self, full, comm, sequence_parallel=False, sp_keep_gathered=False):
        cfg, t, r = full.config, comm.Get_size(), comm.Get_rank()
        if cfg.n_head % t:
            raise TPError(f"n_head ({cfg.n_head}) must be a multiple of the tensor-parallel size "
                          f"({t}): each rank takes whole heads")
        if sequence_parallel and cfg.n_expert > 0:
            raise TPError("sequence parallelism with mixture of experts is not supported: each rank "
                          "would route only its slice of the sequence (use plain tensor parallelism)")
        self.config, self.seed, self._calls = cfg, full.seed, 0
        self.comm, self.tp, self.tp_rank, self.sequence_parallel = comm, t, r, sequence_parallel
        self.sp_keep_gathered = bool(sp_keep_gathered)
        self.specs = shard_specs(cfg, t)
        whole = dict(full.named_parameters())
        self.full_shapes = {n: tuple(p.shape) for n, p in whole.items()}

        def take(name):
            p = whole.get(name)
            if p is None:
                return None
            return p if name not in self.specs else Parameter(shard(p.data, self.specs[name], r, t))

        tr = full.transformer
        self.lo, _ = vocab_range(cfg.vocab_size, t, r)
        self.transformer = ModuleDict(
            wte=VocabParallelEmbedding(take("transformer.wte.weight"), self.lo),
            wpe=tr.wpe,
            h=ModuleList([ParallelBlock(b, lambda n, i=i: take(f"transformer.h.{i}." + n), comm,
                                        self.sp_keep_gathered) for i, b in enumerate(tr.h)]),
            ln_f=tr.ln_f,
        )
        self.dropout = cfg.dropout
        check_sharded(self)
        self.set_recompute(full.recompute.name, full.recompute.k)     # as the whole model was set

    def set_recompute(self, policy="none", k=None):
        """As GPT.set_recompute: the rerun repeats the forward's f/g collectives (recompute.py).
        With MoE only "none" and "selective", as GPT.set_recompute says why."""
        if self.config.n_expert > 0 and policy in ("full", "every-k"):
            raise ValueError(f"recompute {policy!r} with mixture of experts: the checkpoint's forward runs "
                             f"without a graph, so the MoE auxiliary losses inside it would get no gradient "
                             f"(use 'none' or 'selective')")
        recompute.set_policy(self, policy, k)
        return self

    def forward(self, idx, targets=None, rng=None, cache=None, positions=None):
        """cache: a KVCache of this rank's heads (generation, under no_grad); a step of
        generation feeds one token, which cannot be cut along the sequence, so it runs
        plain tensor parallelism (f and g) even in a sequence-parallel model. positions:
        the global position of each column of idx (as GPT.forward's; default 0..T-1)."""
        idx = to_device(idx)
        B, T = idx.shape
        first = check_positions(self, T, cache)
        if rng is None and self.training and self.dropout > 0:
            rng = DropoutRNG(self.seed, self._calls, range(B))        # as GPT.forward does
            self._calls += 1
        tr, comm, sp = self.transformer, self.comm, self.sequence_parallel and cache is None
        tok = tr.wte(idx)                                     # (B, T, C), zero for others' ids
        where = xp.arange(first, first + T) if positions is None else to_device(positions)
        if sp:
            lo, hi = sequence_bounds(T, comm)
            seq = (T, lo, hi)
            tok = leave_region(tok, comm, sp)                 # (B, T_r, C): my tokens, summed
            pos = tr.wpe(where[lo:hi])                        # (T_r, C)
        else:
            seq = None
            tok = leave_region(tok, comm, sp)                 # (B, T, C): g sums the lookups
            pos = tr.wpe(where)                               # (T, C)
        x = sequence_dropout(tok + pos, self.dropout if self.training else 0.0, rng, seq)
        x = recompute.run_blocks(self.recompute, tr.h, x, rng, seq, caches=None if cache is None else cache.layers)
        logits, loss = self.head(x, targets, sp)
        if loss is not None and self.moe_layers():
            loss = loss + self.moe_aux_loss()       # as GPT.forward: the same on every TP rank
        return logits, loss

    def moe_layers(self):
        """[(block index, MoEMLP)] of the MoE blocks, as GPT.moe_layers."""
        return GPT.moe_layers(self)

    def moe_aux_loss(self):
        return GPT.moe_aux_loss(self)

    def moe_stats(self):
        """As GPT.moe_stats: this rank's routing group(s), the same on every TP rank."""
        return GPT.moe_stats(self)

    # The two ends on their own, for a pipeline stage (pipeline_parallel.PipelineGPT): the
    # first stage embeds, the last one ends in the loss, both with their collectives.
    def embed(self, idx, rng):
        """Token + position embeddings and their dropout, without sequence parallelism:
        (B, T) ids -> (B, T, C), whole on every rank (g sums the vocabulary ranges' lookups)."""
        tr, T = self.transformer, idx.shape[1]
        tok = leave_region(tr.wte(to_device(idx)), self.comm, False)   # (B, T, C)
        x = tok + tr.wpe(xp.arange(T))
        # wpe's flag: a stage's train()/eval() reaches the modules it holds, not this model
        return sequence_dropout(x, self.dropout if tr.wpe.training else 0.0, rng, None)

    def head(self, x, targets=None, sp=False):
        """ln_f, the tied head on my vocabulary columns, the loss: (logits (B, T, V/t), loss)."""
        tr = self.transformer
        x = enter_region(tr.ln_f(x), self.comm, sp)         # (B, T, C): f, or the all-gather
        logits = x @ tr.wte.weight.T                          # (B, T, V/t): my vocabulary
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.lo, self.config.vocab_size, self.comm)
        return logits, loss

    def new_cache(self):
        return KVCache(self.config.n_layer, self.config.block_size)

    def greedy_token(self, logits):
        """The greedy token from my vocabulary's logits (B, V/t): the same id on every rank."""
        return vocab_parallel_argmax(logits, self.lo, self.config.vocab_size, self.comm)

    def replicated_names(self):
        return [n for n, _ in self.named_parameters() if n not in self.specs]

    def configure_optimizers(self, weight_decay, lr, betas=(0.9, 0.95), eps=1e-8):
        return GPT.configure_optimizers(self, weight_decay, lr, betas, eps)


def check_sharded(model):
    """Every single-process parameter is here under its name, at its shard's shape: a
    parameter that silently stayed whole (picotron's pitfall) is an error."""
    mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = sorted(set(model.full_shapes) - set(mine))
    extra = sorted(set(mine) - set(model.full_shapes))
    if missing or extra:
        raise TPError(f"tensor-parallel model: missing {missing}, unexpected {extra}")
    for name, full in model.full_shapes.items():
        spec = model.specs.get(name)
        want = shard_shape(full, spec, model.tp)
        if mine[name] != want:
            raise TPError(f"{name}: shape {mine[name]} on rank {model.tp_rank}, its shard should be "
                          f"{want} ({spec or 'replicated'}; whole {full})")

# ----------------------------------------------------------------------------- gathering back


def gather(comm, local, spec):
    """The whole array from every rank's piece, on the host: MPI's own Allgather (buffers
    of one size) of the pieces brought home with to_numpy, joined by NumPy.

    For comparing and reporting only, so it bypasses minidist.comm and its byte counters.
    """
    if spec is None:
        return to_numpy(local).copy()
    local = np.ascontiguousarray(to_numpy(local))
    out = np.empty((comm.Get_size(),) + local.shape, local.dtype)
    comm.Allgather(local, out)
    return unshard(list(out), spec)


def gather_state(model, arrays=None, prefix=""):
    """{prefix + name: whole array} under the single-process names, padding removed.

    arrays: {name: local array} (default: the parameters' data); every rank of the
    tensor-parallel group must call this, with the same names, in the same order.
    """
    local = arrays if arrays is not None else {n: p.data for n, p in model.named_parameters()}
    return {prefix + n: gather(model.comm, local[n], model.specs.get(n)) for n, _ in model.named_parameters()}

# ----------------------------------------------------------------------------- the training step's slot


class TensorParallelSync(Strategy):
    """The `dp` slot of minidist.train.train_step for a tensor-parallel model.

    sync(), after the last backward: under sequence parallelism the replicated
    parameters (layer norms, row-parallel biases, position table) saw only this rank's
    tokens, so their gradients are all-reduced over the TP group (one flat buffer); then
    the data-parallel `dp` (if any) averages over the replicas. Without sequence
    parallelism every TP rank already holds the same whole gradient of a replicated
    parameter (f's all-reduce made the residual stream's gradient whole).

    grad_norm_sq(params), for train_step's clipping: the squared norm of the whole
    model's gradient, which no rank holds alone. Each shard counts once (one all-reduce
    of one float64 over the TP group), each replicated parameter once (every rank holds
    the same copy: summing it over the group would count it t times). Clipping by each
    rank's own shards would scale each rank's part differently.

    With mixture of experts and expert parallelism, `dp` is the ExpertParallel of
    minidist/parallel/expert_parallel.py (dense mean over the data-parallel ranks, experts
    over the ranks that hold the same ones). The router and the experts are replicated
    over the TP group and each TP rank's gradient of them is already whole, so nothing
    here sums them over the group; in the norm, the experts a rank holds (dp.expert_params)
    are summed over its ep group by the dp slot (dp.expert_grad_norm_sq), each expert
    counted once, and the router counts once with the replicated rest.
    """

    def __init__(self, model, dp=None):
        self.model, self.dp = model, dp

    def backward_context(self, last):
        return self.dp.backward_context(last) if self.dp is not None else super().backward_context(last)

    def sync(self):
        m = self.model
        if m.sequence_parallel:
            params = [p for n, p in m.named_parameters() if n not in m.specs]
            flat = xp.concatenate([(p.grad if p.grad is not None else xp.zeros_like(p.data)).reshape(-1)
                                   for p in params])
            flat = tensor_parallel._all_reduce(m.comm, flat)
            off = 0
            for p in params:
                p.grad = flat[off:off + p.size].reshape(p.shape).copy()
                off += p.size
        if self.dp is not None:
            self.dp.sync()

    def grad_norm_sq(self, params):
        sharded = {id(p) for n, p in self.model.named_parameters() if n in self.model.specs}
        spread = {id(p) for p in self.dp.expert_params} if self.dp is not None else set()  # over ep
        mine = grad_norm_sq([p for p in params if id(p) in sharded])       # this rank's shards
        replicated = grad_norm_sq([p for p in params if id(p) not in sharded and id(p) not in spread])
        experts = self.dp.expert_grad_norm_sq(params) if spread else 0.0
        return float(tensor_parallel._all_reduce(self.model.comm, np.array([mine]))[0]) + replicated + experts
