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
"""
import numpy as np

from minidist.comm import stats
from minidist.comm.checks import (DESC_LEN, PROBLEMS, describe, dtype_of, exchange, kind_code,
                                  local_problem, shape_of)
from minidist.comm.collectives import TAG_ALL_TO_ALL, chunk_bounds, sendrecv
from minidist.comm.watchdog import waiting

MAX_USER_TAG = 19999


def _check_tag(tag):
    if not 0 <= tag <= MAX_USER_TAG:
        raise ValueError(f"tag must be in 0..{MAX_USER_TAG} (higher tags belong to the collectives), not {tag}")


def send(comm, x, dest, tag=0):
    """Send array x to rank dest (blocking until x may be reused)."""
    _check_tag(tag)
    x = np.asarray(x, order="C")
    problem = local_problem(x)
    if problem:
        raise ValueError(f"send: an array of shape {x.shape} and dtype {x.dtype}: {PROBLEMS[problem]}")
    header = describe(x, name="send")
    with waiting(f"send to rank {dest}, tag {tag}"):
        comm.Send(header, dest, tag)                  # first: what is coming
        stats.add_check(sent=header.nbytes)
        comm.Send(x, dest, tag)                       # then: the data itself
    stats.add("send", sent=x.nbytes, messages=1, calls=1)


def recv(comm, source, tag=0):
    """Receive the array rank `source` sends with send(comm, x, dest, tag)."""
    _check_tag(tag)
    header = np.empty(DESC_LEN, dtype=np.int64)
    with waiting(f"recv from rank {source}, tag {tag}"):
        comm.Recv(header, source, tag)                # the shape and dtype to expect
        stats.add_check(recv=header.nbytes, messages=0)
        if header[7] != kind_code("send"):
            raise ValueError(f"recv: the message from rank {source} with tag {tag} is not the "
                             "header of a minidist send (did it use comm.Send directly?)")
        out = np.empty(shape_of(header), dtype_of(header))
        comm.Recv(out, source, tag)
    stats.add("recv", recv=out.nbytes, calls=1)
    return out


def all_to_all(comm, x, axis=0):
    """Rank j gets chunk j of every rank's x (array_split along axis), joined in rank order.

    Ranks' lengths along `axis` may differ (the check all-gathers them anyway), the
    other dimensions and the dtype must agree.
    """
    x = np.asarray(x)
    with stats.counting("all_to_all"), waiting("all_to_all"):
        table = exchange(comm, x, "all_to_all", axis=axis, same_axis=False)
        size, rank = comm.Get_size(), comm.Get_rank()
        axis %= x.ndim
        rows = np.asarray(np.moveaxis(x, axis, 0), order="C")
        row = int(np.prod(rows.shape[1:], dtype=np.int64))
        # what I send: chunk j of my rows goes to rank j
        send_bounds = chunk_bounds(rows.shape[0], size)
        # what I get: from rank i, chunk `rank` of rank i's rows, placed in rank order
        got = [np.diff(chunk_bounds(shape_of(table[i])[axis], size))[rank] for i in range(size)]
        recv_bounds = np.concatenate([[0], np.cumsum(got)]).astype(int)
        out = np.empty((int(recv_bounds[-1]),) + rows.shape[1:], dtype=x.dtype)
        src, dst = rows.reshape(-1), out.reshape(-1)
        piece = lambda a, b, j: a[b[j] * row:b[j + 1] * row]
        piece(dst, recv_bounds, rank)[:] = piece(src, send_bounds, rank)   # my own chunk stays
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            # step k: send rank+k its chunk while rank-k sends me mine
            sendrecv(comm, piece(src, send_bounds, to), to,
                     piece(dst, recv_bounds, frm), frm, TAG_ALL_TO_ALL)
        return np.asarray(np.moveaxis(out, 0, axis), order="C")
