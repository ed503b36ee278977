"""Exercise 04: pipeline schedules as data, and the exchange between two stages.

A schedule is, for each of p ranks, the ordered list of its actions (op, micro_batch,
chunk): ("F", i, 0) is the forward of micro-batch i, ("B", i, 0) its backward (chunk is
0: no interleaving here). Grade your file (4.1 and 4.2 run on one rank too; 4.3 needs
3 ranks or more):

    mpirun -n 3 python -m minidist.grade lessons/exercises/04_pipeline_parallel.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/04_pipeline_parallel.py

The referee is minidist.parallel.schedules.validate plus the simulator: every action
once, a backward after its forward, no rank waiting for ever, the bubble of the formula
(p-1)/(m+p-1), and the memory the schedule is known for. The package's answers are in
minidist/parallel/schedules.py and pipeline_parallel.py under the same names.
"""
import numpy as np  # noqa: F401  (you will want it for exchange)


def gpipe(p, m):
    """GPipe: on every rank, the forwards of micro-batches 0..m-1, then their backwards 0..m-1.

    Return a list of p lists of ("F", i, 0) / ("B", i, 0) tuples. Every rank keeps all m
    micro-batches' activations at the turn from forwards to backwards. The grader accepts
    the backwards in any order (0..m-1, or m-1..0): each is valid with the same bubble.
    """
    raise NotImplementedError("exercise 4.1: gpipe")


def one_f_one_b(p, m):
    """1F1B (PipeDream-Flush): rank r runs a warm-up of min(p - r - 1, m) forwards, then
    alternates one forward and one backward (oldest micro-batch first), then runs the
    remaining backwards. Same bubble as GPipe, but at most p - r micro-batches' activations
    alive on rank r. Example, p = 3, m = 4, rank 0: F0 F1 F2 B0 F3 B1 B2 B3.
    """
    raise NotImplementedError("exercise 4.2: one_f_one_b")


def exchange(comm, send=None, recv=None):
    """One stage's communication between two actions: send what it made, receive what it needs.

    send: None or (array, dest, tag); recv: None or (shape, dtype, source, tag).
    Return (the received array or None, the send's request or None): receive into a new
    array of recv's shape and dtype on every call (the caller keeps using the earlier
    ones), and wait for the receive before returning; return the send's request unwaited
    (None only when send is None): the caller waits for it later. In 1F1B's steady state
    two neighbouring stages call this towards each other at once (one sends activations
    forward, the other gradients back): make sure neither waits for the other.
    Use the buffer methods comm.Irecv / comm.Isend (or Send / Recv) and req.Wait().
    Either of send and recv may be None (the first stage only sends, the last only
    receives); receive from recv's source with recv's tag (not send's dest and tag).

    The grader calls it seven times on every rank, with messages of 266 KB (past MPI's
    eager limit): a line of stages forward (to rank r+1) and backward (to rank r-1),
    neighbours facing each other, and a ring both ways. Its Send and Isend complete only
    when the matching receive is posted, as MPI's do for large messages; it refuses a
    message to or from another rank or tag than the call names, and a Wait on the send
    before the receive is posted. Then it runs lesson 04 (1F1B) on your exchange.
    """
    raise NotImplementedError("exercise 4.3: exchange")
