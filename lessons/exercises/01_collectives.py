"""Exercise 01: write the ring collectives yourself.

Three functions, each mirroring one of minidist/comm/collectives.py by name and
signature. Use only MPI's point-to-point buffer methods on NumPy arrays:

    comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)   # send and receive at once
    comm.Send(buf, dest, tag) / comm.Recv(buf, source, tag)
    comm.Isend(...) / comm.Irecv(...) -> request; MPI.Request.Waitall(requests)

(the upper-case methods move buffers; the lower-case ones pickle Python objects: don't).
No collectives (comm.Allreduce, comm.Allgather, comm.Bcast, ...): this exercise builds
them. Return new arrays of the input's dtype (float32 stays float32), a new one on every
call (not a view of a buffer kept between calls: the grader calls each function many
times and checks that earlier results did not change), and leave the input unchanged.
Replace each `raise` with your code, then grade your file at 3 ranks and at 4 (below 3
the grader fails these exercises: at 2 ranks left and right are the same rank, so a
wrong neighbour would pass):

    mpirun -n 3 python -m minidist.grade lessons/exercises/01_collectives.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/01_collectives.py

The grader runs every check on every rank and hands your functions a communicator that
counts what each rank sends and refuses collectives. It holds you to the ring's bytes, so
a ring with one step too many fails even when its result is right. Its Send waits until
the matching Recv is posted, as MPI may do at any size and does for large messages (a
small Send usually returns at once, but a correct program must not count on it), so a
ring whose ranks all Send before they Recv deadlocks at every size; the grader reports a
deadlock as FAIL after --timeout seconds, naming each rank and what it was waiting for. Lesson 01 draws the
ring step by step: `mpirun -n 4 python -m minidist.lessons.01_collectives`.
"""
import numpy as np  # noqa: F401  (you will want it)
from mpi4py import MPI  # noqa: F401


def ring_reduce_scatter(comm, x, op="sum", axis=0):
    """Reduce x over all ranks; rank r keeps chunk r of numpy.array_split(result, N, axis).

    op: "sum", "avg" (sum / N; float arrays) or "max". Chunks may differ in length by one
    (array_split puts the longer ones first) and some may be empty (len < N).

    The ring, N ranks, rank r, right = (r+1) % N, left = (r-1) % N. Move `axis` to the
    front first (np.moveaxis, then np.ascontiguousarray) so each chunk is contiguous.
    For step s = 0 .. N-2:
        send the partial sum of chunk (r - s - 1) % N to the right
            (at step 0 that is just your own piece of it),
        receive the partial sum of chunk (r - s - 2) % N from the left,
        add your own piece of that chunk to it (np.add(recv, mine, out=recv)).
    After N-1 steps the chunk received last is chunk r, summed over all N ranks.
    Each rank sends (N-1)/N of the array in all.
    """
    raise NotImplementedError("exercise 1.1: ring_reduce_scatter")


def ring_all_gather(comm, x, axis=0):
    """Join every rank's piece x along `axis`, in rank order; every rank gets the whole.

    Pieces may differ in length along `axis` (they are array_split chunks), so first
    learn every rank's length, point-to-point too: e.g. pass the lengths round the ring
    (N-1 Sendrecv steps of one int64 each), or send yours to every other rank. These few
    integers are allowed for in the bytes the grader expects (up to N int64 per step).
    Then allocate the result, copy your piece into its place, and for step s = 0 .. N-2:
        send piece (r - s) % N to the right,
        receive piece (r - s - 1) % N from the left, straight into its place.
    Each rank sends (N-1)/N of the result in all.
    """
    raise NotImplementedError("exercise 1.2: ring_all_gather")


def ring_all_reduce(comm, x, op="sum"):
    """Every rank gets the reduction of x over all ranks, with x's shape.

    Build it from your two functions: reduce-scatter the flattened x, divide your chunk
    by N for "avg", all-gather, reshape. 2(N-1) steps, 2(N-1)/N of the array sent per
    rank: the formula of docs/reference.md, which lesson 01 measures.
    """
    raise NotImplementedError("exercise 1.3: ring_all_reduce")
