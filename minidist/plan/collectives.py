"""Collectives' formulas: the elements each rank sends (exact, for the uneven chunks that
numpy.array_split makes) and the alpha-beta time of each algorithm.

Bytes (docs/reference.md#collectives): a ring all-reduce of M bytes over N ranks sends
2(N-1)/N M per rank; reduce-scatter and all-gather (N-1)/N M each. The functions below
count chunk by chunk, so they are exact when N does not divide the message.

Time, the alpha-beta model (alpha seconds per message, beta seconds per byte; MPICH's
source comments, Thakur, Rabenseifner and Gropp 2005):
  ring all-reduce          2(N-1) alpha + 2(N-1)/N M beta
  ring reduce-scatter      (N-1) alpha + (N-1)/N M beta      (all-gather the same)
"""
from minidist.comm import chunk_bounds


def ring_all_reduce_sent(n, size, rank):
    """Elements rank sends in a ring all-reduce of n: every chunk but its own in the
    reduce-scatter, every chunk but its right neighbour's in the all-gather."""
    if size == 1:
        return 0
    b = chunk_bounds(n, size)
    mine, right = b[rank + 1] - b[rank], b[(rank + 1) % size + 1] - b[(rank + 1) % size]
    return (n - mine) + (n - right)


def ring_reduce_scatter_sent(rows, row, size, rank):
    """Elements sent to reduce-scatter `rows` rows of `row` elements: all but my chunk."""
    b = chunk_bounds(rows, size)
    return (rows - (b[rank + 1] - b[rank])) * row


def ring_all_gather_sent(rows, row, size, rank):
    """Elements sent to all-gather pieces of `rows` rows in all: all but my right neighbour's."""
    b = chunk_bounds(rows, size)
    nxt = (rank + 1) % size
    return (rows - (b[nxt + 1] - b[nxt])) * row


def ring_all_reduce_time(nbytes, size, alpha, beta):
    """Seconds of a ring all-reduce of nbytes over size ranks: 2(N-1) alpha + 2(N-1)/N M beta."""
    if size == 1:
        return 0.0
    return 2 * (size - 1) * alpha + 2 * (size - 1) / size * nbytes * beta


def ring_half_time(nbytes, size, alpha, beta):
    """Seconds of a ring reduce-scatter or all-gather of nbytes (the whole vector) over size
    ranks: (N-1) alpha + (N-1)/N M beta."""
    if size == 1:
        return 0.0
    return (size - 1) * alpha + (size - 1) / size * nbytes * beta
