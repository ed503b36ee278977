"""Tensor parallelism as Megatron-LM does it (Shoeybi et al. 2019, arXiv 1909.08053), the
layers: every weight matrix of the GPT is cut across the t ranks of a tensor-parallel group.
Over 400 lines but one idea: Megatron-LM's f and g and the layers built on them (column-
and row-parallel linear, the vocab-parallel embedding and loss), which share the same two
collectives.

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

On a device (MINIDIST_DEVICE=cuda, or the strict double) the layers compute with xp and
hand device arrays to the comm layer, which stages them through the host or gives them
to a CUDA-aware MPI (minidist/comm/staging.py); split points, vocabulary ranges and
padding are host ints, so no device number is read to decide a shape.

The files of tensor parallelism, each one layer of the story:
    tensor_parallel.py    this file: the communication Functions and the parallel layers
    sequence_parallel.py  the all-gather / reduce-scatter pair that replaces f and g, and the
                          column-parallel linear fused with the all-gather (keeps the slice)
    tp_model.py           the GPT cut into shards, gathered back; the training step's slot
    tp_formulas.py        bytes and activation memory per rank, the lesson's formulas
"""
import numpy as np

from minidist import ops
from minidist.backend import to_device, xp
from minidist.comm import all_reduce, chunk_bounds
from minidist.nn import Module
from minidist.plan.rules import padded_vocab   # the planner counts the same padding (plan/rules.py)
from minidist.tensor import Function, Tensor

# ----------------------------------------------------------------------------- the conjugate pair


def _all_reduce(comm, a, op="sum"):
    """The comm layer's all-reduce: a device array in, a device array out (staged through the
    host, counted, or handed to a CUDA-aware MPI: minidist/comm/staging.py); host in, host out."""
    return all_reduce(comm, a, op=op)

# On arrays, one function per direction: these are what the Functions below (and the
# parallel layers) call, and what exercises 3.1-3.4 ask for
# (lessons/exercises/03_tensor_parallel.py, graded by minidist/grader/checks/ex03_tensor_parallel.py).


def f_forward(comm, x):
    """f going forward: the identity. Every rank already holds the whole input."""
    return x


def f_backward(comm, grad):
    """f going back: all-reduce. Rank r's gradient of the input is only its own columns'
    part of dX = dY A^T, (dY_r) A_r^T; the sum over the t ranks is the whole dX."""
    return _all_reduce(comm, grad)


def g_forward(comm, x):
    """g going forward: all-reduce. Rank r holds X_r A_r, one partial sum of Y = X A."""
    return _all_reduce(comm, x)


def g_backward(comm, grad):
    """g going back: the identity. Y is the plain sum of the parts, so each part's gradient
    is dY itself, which every rank already holds whole."""
    return grad


class CopyToTensorParallel(Function):
    """Megatron's f: identity forward, all-reduce backward. Enters a column-parallel layer.

    forward: every rank already holds the whole input; nothing moves.
    backward: rank r's gradient of the input is (dY_r) A_r^T, its own columns' part of
    dX = dY A^T; the all-reduce sums the t parts so every rank holds the whole dX.
    """
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return f_forward(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return f_backward(ctx.comm, grad)


class ReduceFromTensorParallel(Function):
    """Megatron's g: all-reduce forward, identity backward. Leaves a row-parallel layer.

    forward: rank r holds X_r A_r, a partial sum of Y; the all-reduce adds the t parts.
    backward: Y = sum of the parts, so each part's gradient is dY itself, which every
    rank already holds whole: nothing moves.
    """
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm                  # g_backward has f_backward's signature; it ignores comm
        return g_forward(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return g_backward(ctx.comm, grad)


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


def split_for_rank(a, axis, rank, t):
    """Rank `rank`'s piece of a whole array cut in t along `axis`: chunk `rank` of
    numpy.array_split (pieces differ by one where the length does not divide), a view.

    A column-parallel weight (in, out) is cut along axis 1, its bias along axis 0; a
    row-parallel weight (in, out) along axis 0, its bias not at all (exercise 3.5).
    """
    bounds = chunk_bounds(a.shape[axis], t)
    index = [slice(None)] * a.ndim
    index[axis] = slice(bounds[rank], bounds[rank + 1])
    return a[tuple(index)]


def column_parallel_forward(comm, x, weight, bias):
    """Y_r = f(X) A_r + b_r: this rank's columns of Y = X A + b (exercise 3.6).

    x (..., in) whole on every rank; weight (in, out_r) and bias (out_r,) or None, this
    rank's columns. f going forward moves nothing: no communication.
    """
    y = ops._mm(f_forward(comm, x), weight)
    if bias is not None:
        y += bias
    return y


def column_parallel_backward(comm, x, weight, grad):
    """(dX, dA_r, db_r) from dY_r (..., out_r), this rank's columns of dY (exercise 3.7).

    dA_r = X^T dY_r and db_r = the sum of dY_r over tokens are this rank's columns,
    local; dX = dY A^T = sum over ranks of dY_r A_r^T: f's backward all-reduces it.
    """
    gx, gw = ops.matmul_backward(x, weight, grad)
    gb = grad.reshape(-1, grad.shape[-1]).sum(axis=0)
    return f_backward(comm, gx), gw, gb


def row_parallel_forward(comm, x, weight, bias):
    """Y = g(X_r A_r) + b, whole on every rank (exercise 3.8).

    x (..., in_r) this rank's columns of X (a column-parallel layer's output); weight
    (in_r, out) this rank's rows of A; bias (out,) replicated, or None. The bias is added
    once, after the sum: added before it, it would count t times.
    """
    y = g_forward(comm, ops._mm(x, weight))
    return y if bias is None else y + bias


def row_parallel_backward(comm, x, weight, grad):
    """(dX_r, dA_r, db) from the whole dY (..., out), the same on every rank (exercise 3.9).

    g going back is the identity, so everything is local: dX_r = dY A_r^T (this rank's
    columns of dX), dA_r = X_r^T dY (its rows of dA), db = dY summed over tokens (whole).
    """
    grad = g_backward(comm, grad)
    gx, gw = ops.matmul_backward(x, weight, grad)
    return gx, gw, grad.reshape(-1, grad.shape[-1]).sum(axis=0)


# The two engine Functions around the pairs above. Each calls its pair by plain name, which
# Python looks up in this module when the call runs (as f and g are): the grader can put a
# student's function in their place (exercises 3.6-3.9) and lesson 03 runs on it.

def _grads(ctx, gx, gw, gb):
    return (gx, gw, gb) if len(ctx.needs_input_grad) == 3 else (gx, gw)


class ColumnParallelLinearFunction(Function):
    """Y_r = X A_r (+ b_r) forward, column_parallel_backward's grads back."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, comm=None):
        ctx.comm = comm
        ctx.save_for_backward(x, weight)
        return column_parallel_forward(comm, x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved
        return _grads(ctx, *column_parallel_backward(ctx.comm, x, w, grad))


class RowParallelLinearFunction(Function):
    """Y = sum_r X_r A_r (+ b) forward, row_parallel_backward's grads back."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, comm=None):
        ctx.comm = comm
        ctx.save_for_backward(x, weight)
        return row_parallel_forward(comm, x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved
        return _grads(ctx, *row_parallel_backward(ctx.comm, x, w, grad))


def _apply(function, x, weight, bias, comm):
    args = (x, weight) if bias is None else (x, weight, bias)
    return function.apply(*args, comm=comm)


class ColumnParallelLinear(Module):
    """y_r = x @ W[:, my columns] + b[my columns]: this rank's columns of the output.

    The input enters through f (or the all-gather); the output stays split by columns,
    ready for a local op (GELU, attention) and a row-parallel layer. Under sequence
    parallelism the input is this rank's tokens (B, T_r, in): the layer saves only them
    and gathers them again in backward, or, with keep_gathered, saves the gathered
    (B, T, in) and sends less (sequence_parallel.py weighs the two).
    """

    def __init__(self, weight, bias, comm, keep_gathered=False):
        self.weight, self.bias, self.comm, self.keep_gathered = weight, bias, comm, keep_gathered

    def forward(self, x, sequence_parallel=False):
        if sequence_parallel:                                           # the all-gather, then local
            from minidist.parallel.sequence_parallel import gather_column_linear
            return gather_column_linear(x, self.weight, self.bias, self.comm,
                                        self.keep_gathered)             # (B, T, out / t)
        return _apply(ColumnParallelLinearFunction, x, self.weight, self.bias, self.comm)


class RowParallelLinear(Module):
    """y = sum over ranks of x_r @ W[my rows], then + b: the input arrives split by columns.

    The bias is added once, after the sum (added before, it would count t times), so it
    is replicated, and its gradient is the whole dY's column sum on every rank.
    """

    def __init__(self, weight, bias, comm):
        self.weight, self.bias, self.comm = weight, bias, comm

    def forward(self, x, sequence_parallel=False):
        if sequence_parallel:
            y = ops.linear(x, self.weight)                              # (B, T, out): a partial sum
            y = leave_region(y, self.comm, sequence_parallel)           # summed, my tokens
            return y if self.bias is None else y + self.bias
        return _apply(RowParallelLinearFunction, x, self.weight, self.bias, self.comm)

# ----------------------------------------------------------------------------- vocabulary


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


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    """(loss, probs) of the mean cross-entropy, the (N, V) logits split by vocabulary columns
    (exercise 3.10). Rank r holds logits[:, lo:lo+V_r], targets (N,) whole everywhere.

      m      = all-reduce MAX of each row's local max           (N numbers)
      target = all-reduce SUM of (logit[target] - m), 0 where the target is another rank's
      s      = all-reduce SUM of each row's local sum of exp(logit - m)
      loss   = mean(log s - target)
    probs: exp(logit - m) / s, this rank's columns of the softmax (what the backward needs).
    Padded columns (ids >= vocab_size) count as logit -inf: probability 0, gradient 0.
    """
    n, Vl = logits.shape
    first_pad = max(vocab_size - lo, 0)                         # host ints: no device number is read
    pad = (lo + xp.arange(Vl)) >= vocab_size
    local_max = (xp.where(pad, -xp.inf, logits) if first_pad < Vl else logits).max(axis=1)
    m = _all_reduce(comm, local_max, op="max")                  # (N,)
    probs = logits - m[:, None]                                 # a new array: logits stay as they are
    probs[:, first_pad:] = -xp.inf
    inside = (targets >= lo) & (targets < lo + Vl)
    t_local = xp.where(inside, targets - lo, 0)
    mine = xp.where(inside, probs[xp.arange(n), t_local], 0.0)
    target = _all_reduce(comm, mine)                            # (N,) the target's shifted logit
    xp.exp(probs, out=probs)
    s = _all_reduce(comm, probs.sum(axis=1))                    # (N,)
    loss = (xp.log(s) - target).mean()
    probs /= s[:, None]
    return loss, probs


def vocab_parallel_cross_entropy_backward(probs, targets, lo, grad):
    """d(grad * loss)/d(my logits) = grad * (probs - one_hot(target)) / N, all of it local
    (exercise 3.11): the one-hot has its 1 in this rank's columns only for its targets."""
    n, Vl = probs.shape
    g = probs * (grad / n)
    rows = xp.flatnonzero((targets >= lo) & (targets < lo + Vl))
    g[rows, targets[rows] - lo] -= grad / n
    return g


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy of logits split by vocabulary columns, without gathering them.

    forward: vocab_parallel_cross_entropy_forward, three all-reduces of N numbers.
    backward: vocab_parallel_cross_entropy_backward, local: each rank already has the
    two numbers per row it needs (m and s, inside probs).
    """
    @staticmethod
    def forward(ctx, logits, targets, lo, vocab_size, comm):
        Vl = logits.shape[-1]
        t = targets.reshape(-1)
        loss, probs = vocab_parallel_cross_entropy_forward(comm, logits.reshape(-1, Vl), t, lo, vocab_size)
        ctx.shape, ctx.lo = logits.shape, lo
        ctx.save_for_backward(probs, t)
        return xp.asarray(loss, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        probs, t = ctx.saved
        return vocab_parallel_cross_entropy_backward(probs, t, ctx.lo, grad).reshape(ctx.shape)


def vocab_parallel_cross_entropy(logits, targets, lo, vocab_size, comm):
    return VocabParallelCrossEntropy.apply(logits, targets=to_device(targets), lo=lo,
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
    x = xp.where(pad, -xp.inf, logits) if lo + logits.shape[-1] > vocab_size else logits   # host ints
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
