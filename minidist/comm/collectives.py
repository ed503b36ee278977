"""The ring collectives, written by hand on MPI point-to-point messages.

    mpirun -n 4 python -m minidist.lessons.01_collectives    # watch them run, step by step

Ranks stand in a ring: each sends only to its right neighbour (rank+1) and receives
only from its left (rank-1), N-1 steps per phase, one chunk of 1/N of the array per
step. Bytes each rank sends (docs/reference.md; M the array's bytes, N ranks):

    ring reduce-scatter   N-1 steps       (N-1)/N * M   (ring_reduce_scatter_v: M - my piece)
    ring all-gather       N-1 steps       (N-1)/N * M
    ring all-reduce       2(N-1) steps   2(N-1)/N * M    (= reduce-scatter + all-gather)

(For small messages, algorithms with lg N steps: algorithms.py; all_reduce(algorithm=) in
dispatch.py runs any of them by name, "auto" the alpha-beta model's pick: tuning.py.)

Every rank sends and receives at once (Sendrecv), so all links are busy every step and
the time hardly grows with N: that is why the ring wins for large arrays. Chunks are
`numpy.array_split` chunks: chunk c of a length-n array starts at c*q + min(c, n % N).

Conventions for every collective in minidist.comm: it takes an mpi4py communicator and
a NumPy array, never changes the input, returns a new array, moves buffers with the
upper-case mpi4py methods (never pickling), and counts its traffic in
minidist.comm.stats. Before moving data it checks that the ranks' inputs belong
together (minidist.comm.checks; `check=False` skips that small extra message). A device
array (CuPy's) is taken too and its kind returned: minidist/comm/staging.py says how, and
why the array functions here come from `xp = namespace(x)`, NumPy's for a host array.
"""
import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.checks import exchange, finish_avg, reduce_ufunc, refuse, shape_of, wire
from minidist.comm.staging import asarray, contiguous, hand_to_mpi, namespace, staged
from minidist.plan.rules import chunk_bounds   # numpy.array_split's cut, once (plan/rules.py)
from minidist.comm.watchdog import waiting

# Tags of the blocking collectives: a range of their own, so a user's send/recv (tags
# below 20000) or a non-blocking all-reduce in flight (20000-29999) never matches them.
TAG_REDUCE_SCATTER, TAG_ALL_GATHER, TAG_ALL_TO_ALL = 30001, 30002, 30003


def sendrecv(comm, sendbuf, dest, recvbuf, source, tag):
    """One ring step: send `sendbuf` to dest while receiving `recvbuf` from source."""
    comm.Sendrecv(wire(sendbuf), dest, tag, wire(recvbuf), source, tag)
    stats.add(sent=sendbuf.nbytes, recv=recvbuf.nbytes, messages=1)


def _flat(x):
    """A 1-D contiguous view of x (a copy only when x is not contiguous)."""
    return contiguous(x).reshape(-1)


# ----------------------------------------------------------------------------- the ring's two phases

def _reduce_scatter_phase(comm, src, bounds, op, recv_buffer):
    """Ring reduce-scatter of the flat array `src`; returns this rank's reduced chunk.

    `recv_buffer(step, c)` gives the place chunk c's partial sum lands in at `step`. At
    step s rank r sends chunk (r-s-1) and receives chunk (r-s-2), which it adds its own
    piece of; after N-1 steps the chunk it received last, chunk r, holds all N pieces.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    combine = reduce_ufunc(op, namespace(src))
    mine = src[bounds[rank]:bounds[rank + 1]]
    partial = None
    for step in range(size - 1):
        send_c, recv_c = (rank - step - 1) % size, (rank - step - 2) % size
        # first step: my own piece of send_c; later: the partial I completed last step
        sendbuf = src[bounds[send_c]:bounds[send_c + 1]] if step == 0 else partial
        recvbuf = recv_buffer(step, recv_c)
        # pass a partial sum to the right neighbour, take one from the left
        sendrecv(comm, sendbuf, right, recvbuf, left, TAG_REDUCE_SCATTER)
        # add my own piece of that chunk, in place in the receive buffer
        combine(recvbuf, src[bounds[recv_c]:bounds[recv_c + 1]], out=recvbuf)
        partial = recvbuf
    return mine.copy() if partial is None else partial


def _all_gather_phase(comm, out, bounds):
    """Ring all-gather in place in the flat array `out`, where chunk `rank` is filled.

    At step s rank r forwards chunk (r-s) to the right and receives chunk (r-s-1) from
    the left, straight into its place: after N-1 steps every chunk has arrived.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_c, recv_c = (rank - step) % size, (rank - step - 1) % size
        sendrecv(comm, out[bounds[send_c]:bounds[send_c + 1]], right,
                 out[bounds[recv_c]:bounds[recv_c + 1]], left, TAG_ALL_GATHER)


# ----------------------------------------------------------------------------- public ring collectives

@staged
def ring_reduce_scatter(comm, x, op="sum", axis=0, check=True):
    """Reduce x over all ranks and keep chunk `rank` of numpy.array_split(result, N, axis)."""
    x = asarray(x)
    n = x.shape[axis % x.ndim] if x.ndim else 0
    return _ring_reduce_scatter(comm, x, np.diff(chunk_bounds(n, comm.Get_size())), op, axis, check,
                                "ring_reduce_scatter")


@staged
def ring_reduce_scatter_v(comm, x, lengths, op="sum", axis=0, check=True):
    """Reduce x over all ranks and keep rank r's piece along `axis`, lengths[r] long (pieces
    in rank order, any lengths that add up to x.shape[axis]: ring_reduce_scatter with the
    caller's cut instead of numpy.array_split's). Rank r sends every piece's partial sum but
    its own: (M - its piece's bytes), in N-1 steps. Counted under "reduce_scatter"."""
    return _ring_reduce_scatter(comm, asarray(x), lengths, op, axis, check, "ring_reduce_scatter_v")


def _ring_reduce_scatter(comm, x, lengths, op, axis, check, name):
    """The ring reduce-scatter of both faces above: rank r keeps piece r, lengths[r] rows."""
    with stats.counting("reduce_scatter"), waiting(name):
        if check:
            exchange(comm, x, name, op=op, axis=axis)
        else:
            refuse(comm, x, name, op=op, axis=axis)
        size, rank = comm.Get_size(), comm.Get_rank()
        axis %= x.ndim
        lengths = [int(n) for n in lengths]
        if len(lengths) != size or sum(lengths) != x.shape[axis] or min(lengths) < 0:
            raise ValueError(f"{name}: lengths {lengths} must be {size} pieces "
                             f"adding up to the {x.shape[axis]} rows along axis {axis}")
        xp = namespace(x)
        rows = xp.moveaxis(x, axis, 0)               # split along the first axis...
        src = _flat(rows)                             # ...so every chunk is contiguous
        row = int(np.prod(rows.shape[1:], dtype=np.int64))
        bounds = [int(b) * row for b in np.concatenate([[0], np.cumsum(lengths)])]
        longest = max(lengths) * row
        # two chunk-sized buffers, used in turn: what I send next is what I received last
        bufs = [xp.empty(longest, x.dtype), xp.empty(longest if size > 2 else 0, x.dtype)]
        mine = _reduce_scatter_phase(
            comm, src, bounds, op, lambda step, c: bufs[step % 2][:bounds[c + 1] - bounds[c]])
        if op == "avg":
            finish_avg(mine, size)
        chunk = mine.reshape((lengths[rank],) + rows.shape[1:])
        return xp.asarray(xp.moveaxis(chunk, 0, axis), order="C")


@staged
def ring_all_gather(comm, x, axis=0):
    """Join every rank's piece along `axis`, in rank order; pieces' lengths may differ.

    The pieces' lengths come from the descriptors the check all-gathers first (one
    small message, counted under "check"), so this collective always checks.
    """
    x = asarray(x)
    xp = namespace(x)
    with stats.counting("all_gather"), waiting("ring_all_gather"):
        table = exchange(comm, x, "ring_all_gather", axis=axis, same_axis=False)
        size, rank = comm.Get_size(), comm.Get_rank()
        axis %= x.ndim
        rows = xp.moveaxis(x, axis, 0)
        lengths = [shape_of(table[r])[axis] for r in range(size)]
        out = xp.empty((sum(lengths),) + rows.shape[1:], dtype=x.dtype)
        row = int(np.prod(rows.shape[1:], dtype=np.int64))
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n * row)
        flat = out.reshape(-1)
        flat[bounds[rank]:bounds[rank + 1]] = rows.reshape(-1)   # my own piece, in its place
        _all_gather_phase(comm, flat, bounds)
        return xp.asarray(xp.moveaxis(out, 0, axis), order="C")


@staged
def ring_all_reduce(comm, x, op="sum", check=True):
    """Every rank gets the reduction of x over all ranks: ring reduce-scatter, then ring all-gather.

    The result buffer doubles as the receive buffer: partial sums land in their chunk's
    place, so besides the result nothing is allocated and nothing is copied.
    """
    x = asarray(x)
    with stats.counting("all_reduce"), waiting("ring_all_reduce"):
        if check:
            exchange(comm, x, "ring_all_reduce", op=op)
        else:
            refuse(comm, x, "ring_all_reduce", op=op)
        size, rank = comm.Get_size(), comm.Get_rank()
        src = _flat(x)
        out = namespace(src).empty_like(src)
        bounds = chunk_bounds(src.size, size)
        lo, hi = bounds[rank], bounds[rank + 1]
        if size == 1:
            out[:] = src
        else:
            _reduce_scatter_phase(comm, src, bounds, op, lambda step, c: out[bounds[c]:bounds[c + 1]])
        if op == "avg":
            finish_avg(out[lo:hi], size)     # divide my finished chunk once, before sharing it
        _all_gather_phase(comm, out, bounds)
        return out.reshape(x.shape)


@staged
def mpi_all_reduce(comm, x, op="sum"):
    """MPI's own Allreduce: the baseline the hand-written ones are measured against.

    It sends no check of its own (all_reduce(impl="mpi") checks first); what this rank
    can see alone (an unknown op, an integer avg) is still refused.
    """
    x = asarray(x)
    refuse(comm, x, "mpi_all_reduce", op=op)
    with stats.counting("mpi_all_reduce"), waiting("mpi_all_reduce"):
        xp = namespace(x)
        src = xp.asarray(x, order="C")
        out = xp.empty_like(src)
        comm.Allreduce(hand_to_mpi(src), hand_to_mpi(out), op=MPI.MAX if op == "max" else MPI.SUM)
        return finish_avg(out, comm.Get_size()) if op == "avg" else out

