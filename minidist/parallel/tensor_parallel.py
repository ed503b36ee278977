"""Tensor parallelism as Megatron-LM does it (Shoeybi et al. 2019, arXiv 1909.08053):
every weight matrix of the GPT is cut across the t ranks of a tensor-parallel group.

    mpirun -n 4 python -m minidist.lessons.03_tensor_parallel

A Linear computes Y = X A with A of shape (in, out). Cut A by columns, A = [A_1 .. A_t],
and rank r computes Y_r = X A_r: its own columns of Y, from the whole X. Cut A by rows,
and rank r computes X_r A_r from its own columns X_r of X; Y is the sum over ranks.
So a column-parallel layer followed by a row-parallel one needs the whole input once and
one sum at the end, and whatever runs between them per column (GELU; attention, per
head) stays local:

    MLP:        x --f--> [x A_r] --GELU--> [. B_r] --g--> sum + bias
    attention:  x --f--> [q|k|v of my heads] --attention--> [. P_r] --g--> sum + bias

f: identity forward, all-reduce backward (every rank's input gradient is only its
   columns' part of the sum). g: all-reduce forward, identity backward. Each is the
   other's conjugate. Per transformer layer: 2 all-reduces of b*s*h in forward and 2 in
   backward, 8 b*s*h (t-1)/t elements sent per rank (docs/reference.md#tensor-parallelism), nothing else.

The token table is cut by rows (vocabulary ranges), and as the output head it is cut by
columns: the logits of the vocabulary are never whole on one rank. The loss needs only
three all-reduces of b*s numbers (max, sum of exponentials, target logit). The
vocabulary is padded to a multiple of t with zero rows, as Megatron does; padded
columns get logit -inf, so they never touch the loss, the gradients or the sampling.

Sequence parallelism (minidist/parallel/sequence_parallel.py) swaps f and g for an
all-gather and a reduce-scatter along the sequence. `TensorParallelGPT` is built from
the single-process GPT (every rank builds the same one from the seed and keeps its
shards); `gather_state` puts the shards back together under the single-process names.
Memory: each rank holds 1/t of the matrices and the token table, plus the replicated
layer norms, position table and row-parallel biases.
"""
import math

import numpy as np

from minidist import ops
from minidist.backend import to_numpy, xp
from minidist.comm import all_reduce, chunk_bounds
from minidist.nn import Module, ModuleDict, ModuleList, Parameter
from minidist.tensor import Function, Tensor

# ----------------------------------------------------------------------------- the conjugate pair


def _all_reduce(comm, a, op="sum"):
    return xp.asarray(all_reduce(comm, to_numpy(a), op=op))


class CopyToTensorParallel(Function):
    """Megatron's f: identity forward, all-reduce backward. Enters a column-parallel layer.

    forward: every rank already holds the whole input; nothing moves.
    backward: rank r's gradient of the input is (dY_r) A_r^T, its own columns' part of
    dX = dY A^T; the all-reduce sums the t parts so every rank holds the whole dX.
    """
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(ctx.comm, grad)


class ReduceFromTensorParallel(Function):
    """Megatron's g: all-reduce forward, identity backward. Leaves a row-parallel layer.

    forward: rank r holds X_r A_r, a partial sum of Y; the all-reduce adds the t parts.
    backward: Y = sum of the parts, so each part's gradient is dY itself, which every
    rank already holds whole: nothing moves.
    """
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm                  # unused by the right backward; a planted bug uses it
        return _all_reduce(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tp(x, comm):
    return CopyToTensorParallel.apply(x, comm=comm)


def reduce_from_tp(x, comm):
    return ReduceFromTensorParallel.apply(x, comm=comm)

# ----------------------------------------------------------------------------- column and row


def enter_region(x, comm, sequence_parallel):
    """Into a tensor-parallel region: f, or the all-gather of sequence parallelism."""
    if sequence_parallel:
        from minidist.parallel.sequence_parallel import gather_from_sequence
        return gather_from_sequence(x, comm)
    return copy_to_tp(x, comm)


def leave_region(x, comm, sequence_parallel):
    """Out of a tensor-parallel region: g, or the reduce-scatter of sequence parallelism."""
    if sequence_parallel:
        from minidist.parallel.sequence_parallel import reduce_scatter_to_sequence
        return reduce_scatter_to_sequence(x, comm)
    return reduce_from_tp(x, comm)


class ColumnParallelLinear(Module):
    """y_r = x @ W[:, my columns] + b[my columns]: this rank's columns of the output.

    The input enters through f (or the all-gather); the output stays split by columns,
    ready for a local op (GELU, attention) and a row-parallel layer.
    """

    def __init__(self, weight, bias, comm, sequence_parallel):
        self.weight, self.bias = weight, bias
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, x):
        x = enter_region(x, self.comm, self.sequence_parallel)     # (B, T, in) whole
        return ops.linear(x, self.weight, self.bias)                # (B, T, out / t)


class RowParallelLinear(Module):
    """y = sum over ranks of x_r @ W[my rows], then + b: the input arrives split by columns.

    The bias is added once, after the sum (added before, it would count t times), so it
    is replicated, and its gradient is the whole dY's column sum on every rank.
    """

    def __init__(self, weight, bias, comm, sequence_parallel):
        self.weight, self.bias = weight, bias
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, x):
        y = ops.linear(x, self.weight)                              # (B, T, out): a partial sum
        y = leave_region(y, self.comm, self.sequence_parallel)      # summed (SP: my tokens)
        return y if self.bias is None else y + self.bias

# ----------------------------------------------------------------------------- vocabulary


def padded_vocab(vocab_size, t):
    """The vocabulary rounded up to a multiple of t (Megatron pads to 128 t; t is enough here)."""
    return -(-vocab_size // t) * t


def vocab_range(vocab_size, t, rank):
    """[lo, hi): the rows of the padded token table that `rank` owns."""
    per = padded_vocab(vocab_size, t) // t
    return rank * per, (rank + 1) * per


def vocab_parallel_embedding(idx, weight, lo):
    """Rows of this rank's slice of wte for the ids it owns, zero for every other id.

    Summed over the ranks (g, or the reduce-scatter), every id finds its one row: the
    sum adds exact zeros, so the result equals the single-process lookup bit for bit.
    """
    inside = (idx >= lo) & (idx < lo + weight.shape[0])
    local = xp.where(inside, idx - lo, 0)                   # other ranks' ids: any row, masked below
    rows = ops.embedding(local, weight)                     # (B, T, C)
    return rows * Tensor(inside[..., None].astype(weight.dtype))


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy of logits split by vocabulary columns, without gathering them.

    forward, with rank r holding columns [lo, hi) of the (N, V) logits:
      m      = all-reduce MAX of each row's local max           (N numbers)
      target = all-reduce SUM of (logit[target] - m), 0 where the target is another rank's
      s      = all-reduce SUM of each row's local sum of exp(logit - m)
      loss   = mean(log s - target)
    backward: dlogits = (exp(logit - m) / s - one_hot(target)) / N, all of it local:
    each rank already has the two numbers per row it needs.
    Padded columns (ids >= vocab_size) get logit -inf: probability 0, gradient 0.
    """
    @staticmethod
    def forward(ctx, logits, targets, lo, vocab_size, comm):
        Vl = logits.shape[-1]
        x, t = logits.reshape(-1, Vl), targets.reshape(-1)          # (N, Vl), (N,)
        n = len(t)
        pad = (lo + xp.arange(Vl)) >= vocab_size
        local_max = (xp.where(pad, -xp.inf, x) if pad.any() else x).max(axis=1)
        m = _all_reduce(comm, local_max, op="max")                  # (N,)
        probs = x - m[:, None]
        probs[:, pad] = -xp.inf
        inside = (t >= lo) & (t < lo + Vl)
        t_local = xp.where(inside, t - lo, 0)
        mine = xp.where(inside, probs[xp.arange(n), t_local], 0.0)
        target = _all_reduce(comm, mine)                            # (N,) the target's shifted logit
        xp.exp(probs, out=probs)
        s = _all_reduce(comm, probs.sum(axis=1))                    # (N,)
        loss = (xp.log(s) - target).mean()
        probs /= s[:, None]
        ctx.shape = logits.shape
        ctx.save_for_backward(probs, t_local, inside)
        return xp.asarray(loss, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        probs, t_local, inside = ctx.saved
        n = probs.shape[0]
        g = probs * (grad / n)
        rows = xp.flatnonzero(inside)
        g[rows, t_local[rows]] -= grad / n
        return g.reshape(ctx.shape)


def vocab_parallel_cross_entropy(logits, targets, lo, vocab_size, comm):
    return VocabParallelCrossEntropy.apply(logits, targets=xp.asarray(targets), lo=lo,
                                           vocab_size=vocab_size, comm=comm)

# ----------------------------------------------------------------------------- dropout, exactly


class SlicedRNG:
    """A DropoutRNG seen through a slice: the whole mask the single process draws, cut as
    this rank's tensor is cut (heads of the attention probabilities; tokens under
    sequence parallelism).

    Megatron keeps one RNG stream per rank for sharded regions, which is cheaper but can
    never match one process. Drawing the whole mask and keeping a slice costs t times the
    random numbers and keeps every mask identical to the single-process run's.
    """

    def __init__(self, rng, full_shape, index):
        self.rng, self.full_shape, self.index = rng, tuple(full_shape), index

    def mask(self, shape, p, dtype):
        m = xp.ascontiguousarray(self.rng.mask(self.full_shape, p, dtype)[self.index])
        if m.shape != tuple(shape):
            raise ValueError(f"sliced mask has shape {m.shape}, the tensor has shape {tuple(shape)}")
        return m


def sequence_dropout(x, p, rng, seq):
    """Dropout on a (B, T, C) activation, or on this rank's tokens of it (seq = (T, lo, hi))."""
    if p == 0.0 or rng is None:
        return x
    if seq is not None:
        B, _, C = x.shape
        T, lo, hi = seq
        rng = SlicedRNG(rng, (B, T, C), (slice(None), slice(lo, hi)))
    return ops.dropout(x, p, rng)

# ----------------------------------------------------------------------------- gradient clipping


def clip_grad_norm_tp(named_params, max_norm, comm, sharded):
    """minidist.optim.clip_grad_norm for a sharded model: the global norm counts each shard
    once (one all-reduce of one float64 over the TP group) and each replicated parameter
    once (every rank holds the same copy). `sharded`: names of the sharded parameters."""
    sq_sharded, sq_replicated = 0.0, 0.0
    for name, p in named_params:
        if p.grad is not None:
            sq = float(xp.vdot(p.grad.ravel(), p.grad.ravel()))
            if name in sharded:
                sq_sharded += sq
            else:
                sq_replicated += sq
    total = math.sqrt(float(_all_reduce(comm, np.array([sq_sharded]))[0]) + sq_replicated)
    if total > max_norm:
        scale = max_norm / (total + 1e-6)
        for _, p in named_params:
            if p.grad is not None:
                p.grad = p.grad * scale
    return total

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
    """{name: Shard} for every sharded parameter of the GPT; the others are replicated."""
    V = config.vocab_size
    specs = {"transformer.wte.weight": Shard(0, size=V, padded=padded_vocab(V, t))}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        specs[h + "attn.c_attn.weight"] = Shard(1, blocks=3)        # column-parallel, q|k|v
        specs[h + "mlp.c_fc.weight"] = Shard(1)                     # column-parallel
        specs[h + "attn.c_proj.weight"] = Shard(0)                  # row-parallel
        specs[h + "mlp.c_proj.weight"] = Shard(0)                   # row-parallel
        if config.bias:
            specs[h + "attn.c_attn.bias"] = Shard(0, blocks=3)
            specs[h + "mlp.c_fc.bias"] = Shard(0)
    return specs


def shard(full, spec, rank, t):
    """This rank's piece of a whole array (a copy); `spec` None means replicated."""
    if spec is None:
        return full.copy()
    if spec.padded is not None and spec.padded != full.shape[spec.axis]:
        widths = [(0, 0)] * full.ndim
        widths[spec.axis] = (0, spec.padded - full.shape[spec.axis])
        full = xp.pad(full, widths)
    blocks = xp.split(full, spec.blocks, axis=spec.axis)
    return xp.concatenate([xp.split(b, t, axis=spec.axis)[rank] for b in blocks], axis=spec.axis)


def unshard(pieces, spec):
    """The whole array from every rank's piece (in rank order), padding removed."""
    if spec is None:
        return pieces[0]
    per_rank = [xp.split(p, spec.blocks, axis=spec.axis) for p in pieces]
    whole = xp.concatenate([xp.concatenate([pr[b] for pr in per_rank], axis=spec.axis)
                            for b in range(spec.blocks)], axis=spec.axis)
    if spec.size is not None:
        whole = xp.take(whole, xp.arange(spec.size), axis=spec.axis)
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

    def __init__(self, full, take, comm, sp):
        self.c_attn = ColumnParallelLinear(take("c_attn.weight"), take("c_attn.bias"), comm, sp)
        self.c_proj = RowParallelLinear(take("c_proj.weight"), take("c_proj.bias"), comm, sp)
        self.n_head, self.dropout = full.n_head, full.dropout
        self.t, self.rank = comm.Get_size(), comm.Get_rank()

    def forward(self, x, rng, seq):
        qkv = self.c_attn(x)                                           # (B, T, 3C/t)
        B, T, C3 = qkv.shape
        nh, c = self.n_head // self.t, C3 // 3                         # my heads, my channels
        q, k, v = ops.split(qkv, c, axis=2)                            # 3 x (B, T, C/t)
        q = q.reshape(B, T, nh, c // nh).transpose(1, 2)               # (B, nh/t, T, hs)
        k = k.reshape(B, T, nh, c // nh).transpose(1, 2)
        v = v.reshape(B, T, nh, c // nh).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        heads = slice(self.rank * nh, (self.rank + 1) * nh)
        att_rng = SlicedRNG(rng, (B, self.n_head, T, T), (slice(None), heads)) if p > 0 else None
        y = ops.causal_attention(q, k, v, dropout_p=p, rng=att_rng)   # (B, nh/t, T, hs)
        y = y.transpose(1, 2).reshape(B, T, c)                         # (B, T, C/t)
        return sequence_dropout(self.c_proj(y), p, rng, seq)           # (B, T or T_r, C)


class ParallelMLP(Module):
    def __init__(self, full, take, comm, sp):
        self.c_fc = ColumnParallelLinear(take("c_fc.weight"), take("c_fc.bias"), comm, sp)
        self.c_proj = RowParallelLinear(take("c_proj.weight"), take("c_proj.bias"), comm, sp)
        self.p = full.dropout.p

    def forward(self, x, rng, seq):
        h = ops.gelu(self.c_fc(x))                                     # (B, T, 4C/t), local GELU
        return sequence_dropout(self.c_proj(h), self.p if self.training else 0.0, rng, seq)


class ParallelBlock(Module):
    def __init__(self, full, take, comm, sp):
        self.ln_1 = full.ln_1                                          # replicated
        self.attn = ParallelAttention(full.attn, lambda n: take("attn." + n), comm, sp)
        self.ln_2 = full.ln_2
        self.mlp = ParallelMLP(full.mlp, lambda n: take("mlp." + n), comm, sp)

    def forward(self, x, rng, seq):
        x = x + self.attn(self.ln_1(x), rng, seq)
        x = x + self.mlp(self.ln_2(x), rng, seq)
        return x


class VocabParallelEmbedding(Module):
    def __init__(self, weight, lo, vocab_size):
        self.weight, self.lo, self.vocab_size = weight, lo, vocab_size

    def forward(self, idx):
        return vocab_parallel_embedding(idx, self.weight, self.lo)


class TensorParallelGPT(Module):
    """The GPT cut across the ranks of `comm` (a tensor-parallel group), from the whole one.

    Every rank builds the same single-process GPT from the seed and hands it here; each
    keeps its shards (`shard_specs`) and the replicated rest, under the same names.
    forward returns this rank's vocabulary columns of the logits and the whole loss.
    """

    def __init__(self, full, comm, sequence_parallel=False):
        cfg, t, r = full.config, comm.Get_size(), comm.Get_rank()
        if cfg.n_head % t:
            raise TPError(f"n_head ({cfg.n_head}) must be a multiple of the tensor-parallel size "
                          f"({t}): each rank takes whole heads")
        self.config, self.seed, self._calls = cfg, full.seed, 0
        self.comm, self.tp, self.tp_rank, self.sequence_parallel = comm, t, r, sequence_parallel
        self.specs = shard_specs(cfg, t)
        whole = dict(full.named_parameters())
        self.full_shapes = {n: tuple(p.shape) for n, p in whole.items()}

        def take(name):
            p = whole.get(name)
            if p is None:
                return None
            return p if name not in self.specs else Parameter(shard(p.data, self.specs[name], r, t))

        tr, sp = full.transformer, sequence_parallel
        self.lo, _ = vocab_range(cfg.vocab_size, t, r)
        self.transformer = ModuleDict(
            wte=VocabParallelEmbedding(take("transformer.wte.weight"), self.lo, cfg.vocab_size),
            wpe=tr.wpe,
            h=ModuleList([ParallelBlock(b, lambda n, i=i: take(f"transformer.h.{i}." + n), comm, sp)
                          for i, b in enumerate(tr.h)]),
            ln_f=tr.ln_f,
        )
        self.dropout = cfg.dropout
        check_sharded(self)

    def forward(self, idx, targets=None, rng=None):
        idx = xp.asarray(idx)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        if rng is None and self.training and self.dropout > 0:
            from minidist.rng import DropoutRNG
            rng = DropoutRNG(self.seed, self._calls, range(B))        # as GPT.forward does
            self._calls += 1
        tr, comm, sp = self.transformer, self.comm, self.sequence_parallel
        tok = tr.wte(idx)                                     # (B, T, C), zero for others' ids
        if sp:
            from minidist.parallel.sequence_parallel import sequence_bounds
            lo, hi = sequence_bounds(T, comm)
            seq = (T, lo, hi)
            tok = leave_region(tok, comm, sp)                 # (B, T_r, C): my tokens, summed
            pos = tr.wpe(xp.arange(lo, hi))                   # (T_r, C)
        else:
            seq = None
            tok = leave_region(tok, comm, sp)                 # (B, T, C): g sums the lookups
            pos = tr.wpe(xp.arange(T))                        # (T, C)
        x = sequence_dropout(tok + pos, self.dropout if self.training else 0.0, rng, seq)
        for block in tr.h:
            x = block(x, rng, seq)
        x = enter_region(tr.ln_f(x), comm, sp)                # (B, T, C): f, or the all-gather
        logits = x @ tr.wte.weight.T                          # (B, T, V/t): my vocabulary
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.lo, self.config.vocab_size, comm)
        return logits, loss

    def sharded_names(self):
        return set(self.specs)

    def replicated_names(self):
        return [n for n, _ in self.named_parameters() if n not in self.specs]

    def configure_optimizers(self, weight_decay, lr, betas=(0.9, 0.95), eps=1e-8):
        from minidist.model import GPT
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
    """The whole array from every rank's piece: MPI's own Allgather (buffers of one size).

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


class TensorParallelSync:
    """The `dp` slot of minidist.train.train_step for a tensor-parallel model.

    sync(), after the last backward: under sequence parallelism the replicated
    parameters (layer norms, row-parallel biases, position table) saw only this rank's
    tokens, so their gradients are all-reduced over the TP group (one flat buffer); then
    the data-parallel `dp` (if any) averages over the replicas. Without sequence
    parallelism every TP rank already holds the same whole gradient of a replicated
    parameter (f's all-reduce made the residual stream's gradient whole).
    """

    def __init__(self, model, dp=None):
        self.model, self.dp = model, dp

    def backward_context(self, last):
        if self.dp is not None:
            return self.dp.backward_context(last)
        import contextlib
        return contextlib.nullcontext()

    def sync(self):
        m = self.model
        if m.sequence_parallel:
            params = [p for n, p in m.named_parameters() if n not in m.specs]
            flat = xp.concatenate([(p.grad if p.grad is not None else xp.zeros_like(p.data)).reshape(-1)
                                   for p in params])
            flat = _all_reduce(m.comm, flat)
            off = 0
            for p in params:
                p.grad = flat[off:off + p.size].reshape(p.shape).copy()
                off += p.size
        if self.dp is not None:
            self.dp.sync()


class ClipThenStep:
    """An optimizer that first clips the gradients by the global norm of the sharded model.

    train_step's own clipping (grad_clip > 0) would take each rank's shards for the whole
    model; give it grad_clip=0 and this optimizer instead: its step() runs after
    train_step has kept the raw gradients, clips with clip_grad_norm_tp, then steps.
    """

    def __init__(self, optimizer, model, max_norm):
        self.optimizer, self.model, self.max_norm, self.norm = optimizer, model, max_norm, None

    def __getattr__(self, name):                  # set_lr, zero_grad, state_bytes, ...
        return getattr(self.optimizer, name)

    def step(self):
        if self.max_norm:
            self.norm = clip_grad_norm_tp(self.model.named_parameters(), self.max_norm,
                                          self.model.comm, self.model.specs)
        self.optimizer.step()


# ----------------------------------------------------------------------------- bytes, by formula


def ring_all_reduce_sent(n, size, rank):
    """Elements rank sends in a ring all-reduce of n: every chunk but its own in the
    reduce-scatter, every chunk but its right neighbour's in the all-gather."""
    if size == 1:
        return 0
    b = _bounds(n, size)
    mine, right = b[rank + 1] - b[rank], b[(rank + 1) % size + 1] - b[(rank + 1) % size]
    return (n - mine) + (n - right)


def ring_reduce_scatter_sent(rows, row, size, rank):
    """Elements sent to reduce-scatter `rows` rows of `row` elements: all but my chunk."""
    b = _bounds(rows, size)
    return (rows - (b[rank + 1] - b[rank])) * row


def ring_all_gather_sent(rows, row, size, rank):
    """Elements sent to all-gather pieces of `rows` rows in all: all but my right neighbour's."""
    b = _bounds(rows, size)
    nxt = (rank + 1) % size
    return (rows - (b[nxt + 1] - b[nxt])) * row


def _bounds(n, size):
    return chunk_bounds(n, size)


def expected_bytes(model, batch, T, micro_batches=1, clip=True, dp_comm=None):
    """{collective: (calls, bytes)} this rank sends in one training step.

    Per micro-batch of `batch` sequences of T tokens (h = n_embd, L layers):
    - plain TP: all-reduces of b*s*h: 2 per layer forward (g) and 2 backward (f), one for
      the embedding (g) and one for the head's input (f); 3 of b*s for the loss;
    - sequence parallel: those 4L + 2 all-reduces become as many all-gathers plus as
      many reduce-scatters along the sequence; the loss keeps its 3 all-reduces;
    per step: under SP, one all-reduce of the replicated parameters' gradients; with
    clipping, one all-reduce of one float64 (the squared norm of the shards); with a
    data-parallel group (NaiveDataParallel), one ring all-reduce per parameter shard.
    """
    cfg, t, r = model.config, model.tp, model.tp_rank
    item = np.dtype(cfg.dtype).itemsize
    L, C, k = cfg.n_layer, cfg.n_embd, micro_batches
    n_big = 4 * L + 2
    out = {"all_reduce": [0, 0], "all_gather": [0, 0], "reduce_scatter": [0, 0]}

    def add(name, calls, elements, itemsize=item):
        out[name][0] += calls
        out[name][1] += elements * itemsize

    if model.sequence_parallel:
        add("all_gather", k * n_big, k * n_big * ring_all_gather_sent(T, batch * C, t, r))
        add("reduce_scatter", k * n_big, k * n_big * ring_reduce_scatter_sent(T, batch * C, t, r))
        n_rep = sum(p.size for n, p in model.named_parameters() if n not in model.specs)
        add("all_reduce", 1, ring_all_reduce_sent(n_rep, t, r))
    else:
        add("all_reduce", k * n_big, k * n_big * ring_all_reduce_sent(batch * T * C, t, r))
    add("all_reduce", 3 * k, 3 * k * ring_all_reduce_sent(batch * T, t, r))
    if clip:
        add("all_reduce", 1, ring_all_reduce_sent(1, t, r), itemsize=8)
    if dp_comm is not None and dp_comm.Get_size() > 1:
        for p in model.parameters():
            add("all_reduce", 1, ring_all_reduce_sent(p.size, dp_comm.Get_size(), dp_comm.Get_rank()),
                itemsize=p.data.itemsize)
    return {name: tuple(v) for name, v in out.items() if v[0]}
