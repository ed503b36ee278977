"""The simple collectives: broadcast, reduce, and two all-reduces to compare with the ring.

    naive all-reduce        reduce to rank 0, then broadcast from it. Rank 0 receives
                            (N-1) M and sends (N-1) M: its link is the bottleneck, and the
                            time grows linearly with N.
    recursive doubling      lg N rounds; in round k a rank swaps its whole array with the
                            rank 2^k away and both add. lg N messages (few: good for tiny
                            arrays) but M bytes per round (many: bad for large ones).
                            MPICH's cost model (docs/reference.md): lg p (alpha + n beta + n gamma).
                            It lives in algorithms.py, beside Rabenseifner's all-reduce.

broadcast and reduce here are linear: the root talks to every other rank in turn. That
is the textbook's first version; MPI's own use trees. Same conventions as the ring
(minidist/comm/collectives.py): new arrays, buffers only, counted, checked, host or device
arrays (minidist/comm/staging.py). A non-root that passes x=None to broadcast gets a host
array: it gave no array whose kind it could be given back.
"""
import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.checks import dtype_of, exchange, finish_avg, reduce_ufunc, refuse, shape_of, wire
from minidist.comm.staging import asarray, namespace, staged
from minidist.comm.watchdog import waiting
# the log-step all-reduces; imported here too, where the lessons first found it
from minidist.comm.algorithms import recursive_doubling_all_reduce  # noqa: F401

TAG_BROADCAST, TAG_REDUCE = 30011, 30012


@staged
def broadcast(comm, x, root=0, check=True):
    """Every rank gets a copy of root's x. Non-roots may pass x=None (shape from the check)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    with stats.counting("broadcast"), waiting("broadcast"):
        x = None if x is None else asarray(x)
        xp = np if x is None else namespace(x)
        if check:
            table = exchange(comm, x, "broadcast", root=root,
                             none_ok=[r for r in range(size) if r != root])
            shape, dtype = shape_of(table[root]), dtype_of(table[root])
        elif x is None:
            raise ValueError("broadcast: a non-root rank that passes x=None needs check=True")
        else:
            refuse(comm, x, "broadcast", root=root)
            shape, dtype = x.shape, x.dtype
        if rank == root:
            out = xp.array(x, copy=True, order="C")
            # the root posts one send per rank, then waits for all of them
            requests = [comm.Isend(wire(out), dest, TAG_BROADCAST) for dest in range(size) if dest != root]
            MPI.Request.Waitall(requests)
            stats.add(sent=out.nbytes * (size - 1), messages=size - 1)
        else:
            out = xp.empty(shape, dtype)
            comm.Recv(wire(out), root, TAG_BROADCAST)               # wait for the root's copy
            stats.add(recv=out.nbytes)
        return out


@staged
def reduce(comm, x, root=0, op="sum", check=True):
    """The root gets the reduction of x over all ranks (summed in rank order); others get None."""
    size, rank = comm.Get_size(), comm.Get_rank()
    x = asarray(x)
    xp = namespace(x)
    with stats.counting("reduce"), waiting("reduce"):
        if check:
            exchange(comm, x, "reduce", op=op, root=root)
        else:
            refuse(comm, x, "reduce", op=op, root=root)
        src = xp.asarray(x, order="C")
        if rank != root:
            comm.Send(wire(src), root, TAG_REDUCE)                  # hand my array to the root
            stats.add(sent=src.nbytes, messages=1)
            return None
        combine, incoming = reduce_ufunc(op, xp), xp.empty_like(src)
        out = None
        for r in range(size):                                 # the root adds them in rank order
            if r == root:
                piece = src
            else:
                comm.Recv(wire(incoming), r, TAG_REDUCE)
                stats.add(recv=incoming.nbytes)
                piece = incoming
            out = piece.copy() if out is None else combine(out, piece, out=out)
        return finish_avg(out, size) if op == "avg" else out


@staged
def naive_all_reduce(comm, x, op="sum", check=True):
    """Reduce to rank 0, then broadcast from rank 0: simple, and rank 0's link does all the work."""
    x = asarray(x)
    with stats.counting("all_reduce"), waiting("naive_all_reduce"):
        if check:
            exchange(comm, x, "naive_all_reduce", op=op)
        else:
            refuse(comm, x, "naive_all_reduce", op=op)
        total = reduce(comm, x, root=0, op=op, check=False)
        if total is None:
            xp = namespace(x)
            total = xp.empty_like(xp.asarray(x, order="C"))    # a buffer for the broadcast
        return broadcast(comm, total, root=0, check=False).reshape(x.shape)
