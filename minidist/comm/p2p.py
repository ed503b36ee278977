"""Point-to-point helpers for pipelines, and all-to-all for experts.

send / recv: one rank hands an array to another (a pipeline stage passes activations
forward and gradients back). A 128-byte header with the shape and dtype goes first,
counted under "check", so the receiver needs to know nothing in advance; then the data,
counted under "send" / "recv". Both messages carry the same tag and MPI keeps messages
between two ranks with one tag in order, so header and data always pair up. Use tags
below 20000; the collectives keep the tags above for themselves.

all_to_all: chunk j of numpy.array_split(x, N, axis) goes to rank j; each rank joins
what it received in rank order. N-1 pairwise steps: at step k send to rank+k while
receiving from rank-k. Each rank sends (N-1)/N * M (docs/reference.md).

all_to_all_v: the same pairwise schedule for chunks of any lengths, as expert
parallelism needs (each rank sends each expert's owner however many tokens chose it).
Every rank first tells each partner how many rows are coming (one int64 per pair,
counted under "check"), then the rows travel. Each rank sends the sum over
destinations j != rank of its chunk j's bytes: rows_j x row size x itemsize.

Host or device arrays (minidist/comm/staging.py), each returned in the kind it came in.
recv is given no array: it returns a host array, or a device one with device=True.
"""
import numpy as np

from minidist import backend
from minidist.comm import staging, stats
from minidist.comm.checks import (DESC_LEN, PROBLEMS, MismatchError, describe, dtype_of, exchange, gather,
                                  kind_code, local_problem, post, shape_of, verify, wire)
from minidist.comm.collectives import TAG_ALL_TO_ALL, chunk_bounds, sendrecv
from minidist.comm.staging import asarray, contiguous, namespace, staged
from minidist.comm.watchdog import waiting

MAX_USER_TAG = 19999


def _check_tag(tag):
    if not 0 <= tag <= MAX_USER_TAG:
        raise ValueError(f"tag must be in 0..{MAX_USER_TAG} (higher tags belong to the collectives), not {tag}")


@staged
def send(comm, x, dest, tag=0):
    """Send array x to rank dest (blocking until x may be reused)."""
    _check_tag(tag)
    x = contiguous(x)
    problem = local_problem(x)
    if problem:
        raise ValueError(f"send: an array of shape {x.shape} and dtype {x.dtype}: {PROBLEMS[problem]}")
    header = describe(x, name="send")
    with waiting(f"send to rank {dest}, tag {tag}"):
        comm.Send(header, dest, tag)                  # first: what is coming
        stats.add_check(sent=header.nbytes)
        comm.Send(wire(x), dest, tag)                 # then: the data itself
    stats.add("send", sent=x.nbytes, messages=1, calls=1)


def recv(comm, source, tag=0, device=False):
    """Receive the array rank `source` sends with send(comm, x, dest, tag): a host array, or
    with device=True a device array (on the CPU, device=True changes nothing)."""
    _check_tag(tag)
    header = np.empty(DESC_LEN, dtype=np.int64)
    with waiting(f"recv from rank {source}, tag {tag}"):
        comm.Recv(header, source, tag)                # the shape and dtype to expect
        stats.add_check(recv=header.nbytes, messages=0)
        if header[7] != kind_code("send"):
            raise ValueError(f"recv: the message from rank {source} with tag {tag} is not the "
                             "header of a minidist send (did it use comm.Send directly?)")
        xp = backend.xp if device and staging.DIRECT else np   # where MPI writes it
        out = xp.empty(shape_of(header), dtype_of(header))
        comm.Recv(wire(out), source, tag)
    stats.add("recv", recv=out.nbytes, calls=1)
    return backend.to_device(out) if device and not staging.DIRECT else out


@staged
def all_to_all(comm, x, axis=0):
    """Rank j gets chunk j of every rank's x (array_split along axis), joined in rank order.

    Ranks' lengths along `axis` may differ (the check all-gathers them anyway), the
    other dimensions and the dtype must agree.
    """
    x = asarray(x)
    xp = namespace(x)
    with stats.counting("all_to_all"), waiting("all_to_all"):
        table = exchange(comm, x, "all_to_all", axis=axis, same_axis=False)
        size, rank = comm.Get_size(), comm.Get_rank()
        axis %= x.ndim
        rows = xp.asarray(xp.moveaxis(x, axis, 0), order="C")
        row = int(np.prod(rows.shape[1:], dtype=np.int64))
        # what I send: chunk j of my rows goes to rank j
        send_bounds = chunk_bounds(rows.shape[0], size)
        # what I get: from rank i, chunk `rank` of rank i's rows, placed in rank order
        got = [np.diff(chunk_bounds(shape_of(table[i])[axis], size))[rank] for i in range(size)]
        recv_bounds = np.concatenate([[0], np.cumsum(got)]).astype(int)
        out = xp.empty((int(recv_bounds[-1]),) + rows.shape[1:], dtype=x.dtype)
        src, dst = rows.reshape(-1), out.reshape(-1)
        piece = lambda a, b, j: a[b[j] * row:b[j + 1] * row]
        piece(dst, recv_bounds, rank)[:] = piece(src, send_bounds, rank)   # my own chunk stays
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            # step k: send rank+k its chunk while rank-k sends me mine
            sendrecv(comm, piece(src, send_bounds, to), to,
                     piece(dst, recv_bounds, frm), frm, TAG_ALL_TO_ALL)
        return xp.asarray(xp.moveaxis(out, 0, axis), order="C")


def _uneven_chunks(chunks, size):
    """Why this rank's chunks cannot travel together (a sentence), or "" when they can."""
    if len(chunks) != size:
        return f"{len(chunks)} chunks for {size} ranks (chunk j goes to rank j: one per rank)"
    first = chunks[0]
    if first.ndim == 0:
        return "chunk 0 is a scalar: chunks are arrays of rows (at least one dimension)"
    for j, c in enumerate(chunks):
        if c.dtype != first.dtype or c.shape[1:] != first.shape[1:]:
            return (f"chunk {j} has rows of shape {c.shape[1:]} {c.dtype}, chunk 0 rows of "
                    f"shape {first.shape[1:]} {first.dtype}: all rows must agree")
    return ""


@staged
def all_to_all_v(comm, send_chunks):
    """Rank j gets send_chunks[j] of every rank; returns the N arrays received, the one
    from rank i at index i. Chunks may have any number of rows (0 included); the rows'
    shape and the dtype must be the same on every rank.

    One check all-gather (every rank's dtype and row shape), then N-1 pairwise steps of
    counts, then N-1 pairwise steps of rows; my own chunk is copied.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    chunks = [contiguous(c) for c in send_chunks]
    with stats.counting("all_to_all"), waiting("all_to_all_v"):
        # agree on dtype and row shape; a rank whose own chunks disagree says so to all
        uneven = _uneven_chunks(chunks, size)
        total = sum(len(c) for c in chunks) if not uneven else 0
        template = (np.empty((total,) + chunks[0].shape[1:], chunks[0].dtype) if chunks
                    and chunks[0].ndim else np.empty(0))
        mine, table = post(comm, template, axis=0, name="all_to_all_v")
        if uneven:
            mine[0] = -1                 # a flag of my own: checks.PROBLEMS has no words for it
        gather(comm, mine, table, "all_to_all_v")
        bad = [r for r in range(size) if table[r, 0] < 0]
        if bad and len(set(table[:, 7])) == 1:      # (different collectives: verify says so)
            raise MismatchError(f"all_to_all_v: rank {bad[0]} passed chunks that cannot travel "
                                "(one array of rows per rank, every row of one shape and dtype)"
                                + (f": {uneven}" if rank == bad[0] else ""))
        verify(table, "all_to_all_v", same_axis=False)
        # counts first: at step k tell rank+k how many rows it gets, hear it from rank-k
        rows = np.array([len(c) for c in chunks], np.int64)
        got = np.zeros(size, np.int64)
        got[rank] = rows[rank]
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            comm.Sendrecv(rows[to:to + 1], to, TAG_ALL_TO_ALL, got[frm:frm + 1], frm, TAG_ALL_TO_ALL)
            stats.add_check(sent=8, recv=8)
        # then the rows: the same schedule, each buffer sized by the count just received
        out = [None] * size
        out[rank] = chunks[rank].copy()                 # my own chunk stays
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            out[frm] = namespace(chunks[rank]).empty((int(got[frm]),) + chunks[rank].shape[1:],
                                                     chunks[rank].dtype)
            # step k: send rank+k its rows while rank-k sends me mine
            sendrecv(comm, chunks[to], to, out[frm], frm, TAG_ALL_TO_ALL)
        return out
