"""Exercise 13: the three pieces of ring attention.

Three functions, each mirroring the package's by name and signature:

- 13.1 `merge_partials` (minidist/attention.py): two partial attention results, each over
  its own set of keys, merged into the result over both sets. Plain NumPy, one process.
- 13.2 `rank_chunks` (minidist/parallel/context_parallel.py): which of the 2 cp chunks of
  the sequence a rank holds, with and without causal load balancing. Plain Python.
- 13.3 `ring_pass_start` (minidist/parallel/context_parallel.py): one step of the ring,
  started and not waited for, so that the next K/V block travels while this one is used.
  MPI's point-to-point buffer methods only: comm.Isend and comm.Irecv (upper case: the
  lower-case methods pickle Python objects), no collectives.

Grade the file under mpirun at 3 ranks and at 4 (13.3 needs at least 3: at 2 ranks the
left and right neighbours are the same rank, so a ring turned the wrong way would pass):

    mpirun -n 3 python -m minidist.grade lessons/exercises/13_context_parallel.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/13_context_parallel.py
    python -m minidist.grade lessons/exercises/13_context_parallel.py      (starts both)

The grader compares each function with its own answer on many inputs. The grader's Isend
completes only when the matching receive is posted (as MPI does for large messages), and
it calls ring_pass_start on one rank while the rank that sends to it has not called it
yet: a ring_pass_start that waits for its messages before returning never returns there,
and the grader reports that as a FAIL after --timeout seconds. After the unit checks
PASS, it plugs your function into the package and runs lesson 13 on it
(`mpirun -n 4 python -m minidist.lessons.13_context_parallel`): an answer that breaks the
lesson never PASSes. Leave the inputs unchanged and return new arrays.
"""
import numpy as np  # noqa: F401  (you will want it)
from mpi4py import MPI  # noqa: F401


def merge_partials(o1, lse1, o2, lse2):
    """Merge two partial attention results over disjoint key sets: return (o, lse).

    o1, o2: (B, nh, T, hs), each normalised over its own keys only; lse1, lse2: (B, nh, T),
    the natural-log log-sum-exp of each query row's (scaled, masked) scores over those
    keys. A row that saw no key on one side has lse = -inf there (and o = 0). Over both
    key sets together:

        lse = log(exp(lse1) + exp(lse2))
        o   = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2

    (the two weights are each side's share of the row's softmax mass, and sum to one).
    Compute it without overflow: lse may be large (hundreds: exp(800) is inf in float64)
    or very negative; subtract the larger of lse1 and lse2 before exponentiating, or use
    np.logaddexp. Rows where one side is -inf take the other side as it is; rows where
    both are -inf (no key at all yet) give lse = -inf and o = 0, never nan.
    Keep the inputs' dtype (float64 stays float64 all the way, float32 stays float32),
    return new arrays, and leave the inputs unchanged: the ring calls it once per step,
    merging each arriving block into the result so far.
    """
    raise NotImplementedError("exercise 13.1: merge_partials")


def rank_chunks(rank, cp, load_balance=True):
    """The chunk indices rank `rank` of `cp` context-parallel ranks holds, in order.

    The sequence is cut into 2 * cp chunks, 0 .. 2cp-1 (numpy.array_split's rule: the
    first chunks one longer when the length does not divide). Each rank holds two:

        load_balance=True:  [rank, 2*cp - 1 - rank]   (Megatron's layout: under the causal
                            mask early chunks are cheap and late ones dear, so every rank
                            takes one of each and all do the same attention work)
        load_balance=False: [2*rank, 2*rank + 1]       (the naive contiguous split: the last
                            rank attends to the whole sequence, the first to a sliver)

    Return a list of two Python ints. Over all ranks the chunks cover 0 .. 2cp-1 once.
    """
    raise NotImplementedError("exercise 13.2: rank_chunks")


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    """Start one ring step: return the requests, without waiting for them.

    n = comm.Get_size(), r = comm.Get_rank(). For each i, in order:
        comm.Irecv(recv_arrays[i], (r - 1) % n, tag)     from the left neighbour,
                                                         straight into the caller's buffer
        comm.Isend(send_arrays[i], (r + 1) % n, tag)     to the right neighbour
    Return the list of requests [recv 0, send 0, recv 1, send 1, ...]: for each i the
    Irecv's request, then the Isend's. The caller computes with the block it holds while
    these travel, then waits (MPI.Request.Waitall(requests)) before it reads recv_arrays
    or reuses send_arrays; the ring's backward waits on requests[0::2] (the receives)
    before it adds what arrived, and on requests[1::2] (the sends) only at the end, so
    the order matters. Do not wait here: that would serialise the exchange and the
    compute, and a rank whose left neighbour has not started yet would wait for it. Use
    the tag you are given (two exchanges may be in flight at once, K/V and dK/dV, each
    with its own tag), keep no buffers between calls (send the caller's arrays
    themselves: a message may leave long after you return), and leave send_arrays as
    they are.
    """
    raise NotImplementedError("exercise 13.3: ring_pass_start")
