"""Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198): the pair of
communication Functions that replaces tensor parallelism's f and g, and the slice of the
sequence each rank keeps between them.

    mpirun -n 4 python -m minidist.lessons.03_tensor_parallel --sequence-parallel

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
next tensor-parallel region: the same bytes per rank as before, (t-1)/t x b*s*h per call,
with 4 all-gathers and 4 reduce-scatters per layer instead of 4 all-reduces.
"""
from minidist.backend import to_numpy, xp
from minidist.comm import chunk_bounds, ring_all_gather, ring_reduce_scatter
from minidist.tensor import Function

SEQ_AXIS = 1            # activations are (B, T, C): the sequence is axis 1


def sequence_bounds(T, comm):
    """(lo, hi): the tokens this rank keeps, chunk `rank` of numpy.array_split(range(T), t)."""
    b = chunk_bounds(T, comm.Get_size())
    r = comm.Get_rank()
    return b[r], b[r + 1]


def _reduce_scatter(comm, a):
    return xp.asarray(ring_reduce_scatter(comm, to_numpy(a), op="sum", axis=SEQ_AXIS))


def _all_gather(comm, a):
    return xp.asarray(ring_all_gather(comm, to_numpy(a), axis=SEQ_AXIS))


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


def gather_from_sequence(x, comm):
    return GatherFromSequence.apply(x, comm=comm)


def reduce_scatter_to_sequence(x, comm):
    return ReduceScatterToSequence.apply(x, comm=comm)
