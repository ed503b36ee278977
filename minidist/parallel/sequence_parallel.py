"""Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198): the pair of
communication Functions that replaces tensor parallelism's f and g, the slice of the
sequence each rank keeps between them, and the column-parallel linear fused with the
all-gather that keeps only that slice for backward.

    mpirun -n 4 python -m minidist.lessons.03_tensor_parallel --sequence-parallel
    mpirun -n 4 python -m minidist.lessons.03_tensor_parallel --sequence-parallel --sp-keep-gathered

Plain tensor parallelism (minidist/parallel/tensor_parallel.py) keeps the residual
stream whole on every rank: layer norms, dropout and the residual adds run t times on
the same numbers, and t copies of their saved activations sit in memory. Sequence
parallelism cuts that replicated region along the sequence axis instead: rank r keeps
tokens [lo_r, hi_r) of every sequence (numpy.array_split chunks, so any length works).
Between the two regions the activations change hands:

    sequence slice --all-gather-->  whole sequence  [column-parallel ... row-parallel]
    whole sequence (partial sums) --reduce-scatter-->  sequence slice, summed

An all-reduce is a reduce-scatter followed by an all-gather, so g (all-reduce) followed
by nothing splits into a reduce-scatter now and an all-gather later, at the entry of the
next tensor-parallel region. Each call sends (t-1)/t x b*s*h per rank. Two variants of
the column-parallel layer behind the all-gather (attention's c_attn, the MLP's c_fc):

- keep-gathered (GatherFromSequence, then a plain linear): the linear saves the whole
  gathered input, 2 b*s*h per layer per rank. 4 all-gathers + 4 reduce-scatters per
  layer, forward and backward: the same bytes per rank as plain TP's 4 all-reduces.
- re-gather (GatherColumnParallelLinear, Megatron's and the default): the fused node
  saves only this rank's slice, 2 b*s*h/t, and all-gathers it again in backward for the
  weight gradient. 6 all-gathers + 4 reduce-scatters per layer: 10 b*s*h (t-1)/t
  elements sent per rank instead of 8, and every activation of the layer is cut by t:
  34sbh/t + 5as^2b/t in the paper's bytes (their section 4.2.2; Megatron hides the
  re-gather behind the input-gradient GEMM, this engine runs it in turn).
"""
from minidist import ops
from minidist.backend import xp
from minidist.comm import chunk_bounds, ring_all_gather, ring_reduce_scatter
from minidist.tensor import Function

SEQ_AXIS = 1            # activations are (B, T, C): the sequence is axis 1


def sequence_bounds(T, comm):
    """(lo, hi): the tokens this rank keeps, chunk `rank` of numpy.array_split(range(T), t)."""
    b = chunk_bounds(T, comm.Get_size())
    r = comm.Get_rank()
    return b[r], b[r + 1]


def _reduce_scatter(comm, a):
    """Along the sequence, by the comm layer: device in, device out (minidist/comm/staging.py)."""
    return ring_reduce_scatter(comm, a, op="sum", axis=SEQ_AXIS)


def _all_gather(comm, a):
    """Along the sequence, by the comm layer: device in, device out (minidist/comm/staging.py)."""
    return ring_all_gather(comm, a, axis=SEQ_AXIS)


class GatherFromSequence(Function):
    """All-gather forward, reduce-scatter backward (along the sequence): enters a
    tensor-parallel region in place of f.

    forward: each rank holds (B, T_r, C), its slice of the sequence; every rank gets the
    whole (B, T, C) to feed its column-parallel layer.
    backward: each rank's gradient of the whole sequence is only its part of the sum
    (its columns' contribution, as in f's backward); the reduce-scatter sums the t parts
    and hands each rank the slice it owns.
    """
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(ctx.comm, grad)


class ReduceScatterToSequence(Function):
    """Reduce-scatter forward, all-gather backward (along the sequence): leaves a
    tensor-parallel region in place of g.

    forward: each rank holds partial sums of the whole (B, T, C) (a row-parallel output,
    or the vocab-parallel embedding); the reduce-scatter adds them and keeps this rank's
    sequence slice, (B, T_r, C).
    backward: the gradient of the slice is the whole answer for those tokens (the sum
    has each partial with coefficient one); the all-gather gives every rank the whole
    sequence's gradient for its partial sums.
    """
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(ctx.comm, grad)


class GatherColumnParallelLinear(Function):
    """All-gather along the sequence, then a column-parallel linear, in one node that keeps
    only this rank's slice for backward (Korthikanti et al. 2022, section 4.2.2).

    forward: X = all-gather(x_r), (B, T_r, in) -> (B, T, in); Y_r = X A_r + b_r, this
    rank's columns (B, T, out_r). X is dropped at once: the node saves x_r, not X.
    backward, from dY_r (B, T, out_r):
      1. dX = dY_r A_r^T, this rank's part of the whole sequence's input gradient (its
         columns' share of the sum, as in f's backward);
      2. X again: the all-gather of x_r (Megatron overlaps it with step 1's GEMM);
      3. the reduce-scatter of dX sums the t parts and keeps this rank's tokens (Megatron
         overlaps it with step 4's GEMM);
      4. dA_r = X^T dY_r and db_r = dY_r summed over tokens, local.
    The same arithmetic as GatherFromSequence then ops.linear, so the same numbers.
    """
    @staticmethod
    def forward(ctx, x, weight, bias=None, comm=None):
        ctx.comm = comm
        ctx.save_for_backward(x, weight)                        # my slice only: (B, T_r, in)
        y = ops._mm(_all_gather(comm, x), weight)               # (B, T, out_r)
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved
        gx = ops._mm(grad, w.T)                                 # (B, T, in): my columns' part
        whole = _all_gather(ctx.comm, x)                        # the re-gather: (B, T, in)
        gx = _reduce_scatter(ctx.comm, gx)                      # (B, T_r, in): summed, my tokens
        gw = whole.reshape(-1, whole.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])
        if len(ctx.needs_input_grad) == 3:
            return gx, gw, grad.reshape(-1, grad.shape[-1]).sum(axis=0)
        return gx, gw


def gather_column_linear(x, weight, bias, comm, keep_gathered=False):
    """This rank's columns of all-gather(x) @ W + b from its slice x (B, T_r, in).

    keep_gathered: the naive way, an all-gather node and a linear that saves the gathered
    input (no re-gather); otherwise the fused node that saves the slice and gathers again.
    """
    if keep_gathered:
        return ops.linear(gather_from_sequence(x, comm), weight, bias)
    args = (x, weight) if bias is None else (x, weight, bias)
    return GatherColumnParallelLinear.apply(*args, comm=comm)


def gather_from_sequence(x, comm):
    return GatherFromSequence.apply(x, comm=comm)


def reduce_scatter_to_sequence(x, comm):
    return ReduceScatterToSequence.apply(x, comm=comm)
