"""Tensor parallelism as Megatron-LM does it (Shoeybi et al. 2019, arXiv 1909.08053), the
layers: every weight matrix of the GPT is cut across the t ranks of a tensor-parallel group.

    mpirun -n 8 python -m minidist.lessons.03_tensor_parallel

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
three all-reduces of b*s numbers (max, sum of exponentials, target logit), and greedy
decoding two (the largest logit, then the smallest id that holds it). The vocabulary is
padded to a multiple of t with zero rows, as Megatron does; padded columns count as
logit -inf, so they never touch the loss, the gradients or the chosen tokens.

The files of tensor parallelism, each one layer of the story:
    tensor_parallel.py    this file: the communication Functions and the parallel layers
    sequence_parallel.py  the all-gather / reduce-scatter pair that replaces f and g
    tp_model.py           the GPT cut into shards, gathered back; the training step's slot
    tp_formulas.py        bytes and activation memory per rank, the lesson's formulas
"""
import numpy as np

from minidist import ops
from minidist.backend import to_numpy, xp
from minidist.comm import all_reduce
from minidist.nn import Module
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

    def __init__(self, weight, bias, comm):
        self.weight, self.bias, self.comm = weight, bias, comm

    def forward(self, x, sequence_parallel=False):
        x = enter_region(x, self.comm, sequence_parallel)          # (B, T, in) whole
        return ops.linear(x, self.weight, self.bias)                # (B, T, out / t)


class RowParallelLinear(Module):
    """y = sum over ranks of x_r @ W[my rows], then + b: the input arrives split by columns.

    The bias is added once, after the sum (added before, it would count t times), so it
    is replicated, and its gradient is the whole dY's column sum on every rank.
    """

    def __init__(self, weight, bias, comm):
        self.weight, self.bias, self.comm = weight, bias, comm

    def forward(self, x, sequence_parallel=False):
        y = ops.linear(x, self.weight)                              # (B, T, out): a partial sum
        y = leave_region(y, self.comm, sequence_parallel)           # summed (SP: my tokens)
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


def vocab_parallel_argmax(logits, lo, vocab_size, comm):
    """Greedy decoding's token, (B, V/t) logits of my vocabulary -> (B,) ids, never gathered.

    all-reduce MAX of each row's local max (B numbers), then all-reduce MAX of minus the
    smallest id of mine that holds it (B numbers): the smallest id overall, numpy.argmax's
    rule for a tie, so one process and t ranks pick the same token. Padded columns count
    as -inf: their logit is 0 (a zero row of the table), which would beat a vocabulary
    whose every real logit is negative.
    """
    pad = (lo + xp.arange(logits.shape[-1])) >= vocab_size
    x = xp.where(pad, -xp.inf, logits) if pad.any() else logits
    mine = x.argmax(axis=-1)                                            # (B,) first local maximum
    local_max = xp.take_along_axis(x, mine[:, None], axis=-1)[:, 0]
    m = _all_reduce(comm, local_max, op="max")
    candidate = xp.where(local_max == m, lo + mine, np.iinfo(np.int64).max).astype(np.int64)
    return -_all_reduce(comm, -candidate, op="max")

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
