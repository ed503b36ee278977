"""Exercise 09: route tokens to experts, and carry them there with an all-to-all.

Two functions, each mirroring the package's by name and signature:

- 9.1 `route` (minidist/moe.py): which experts each token goes to, and which of those
  choices fit within the experts' capacity. Plain NumPy, graded in this one process (no
  MPI job starts; the whole file, without mpirun, grades 9.1 in one process too):

      python -m minidist.grade --only 9.1 -- lessons/exercises/09_moe.py

- 9.2 `all_to_all_v` (minidist/comm/p2p.py): every rank sends rank j the rows meant for
  it, any number of rows (0 included), and gets back the rows every rank meant for it.
  Use only MPI's point-to-point buffer methods on NumPy arrays (comm.Sendrecv, Send/Recv,
  Isend/Irecv + MPI.Request.Waitall); no collectives (comm.Alltoallv, comm.Allgather, ...):
  the exercise builds one. Grade it under mpirun at 3 ranks and at 4 (below 3 the grader
  fails it: at 2 ranks, rank + k and rank - k are the same rank, so a wrong pairing passes):

      mpirun -n 3 python -m minidist.grade lessons/exercises/09_moe.py
      mpirun -n 4 python -m minidist.grade lessons/exercises/09_moe.py

The grader's Send waits until the matching Recv is posted (as MPI does for large
messages), so ranks that all Send before they Recv deadlock; it reports that as a FAIL
after --timeout seconds. After the unit checks PASS, it plugs your function into the
package and runs lesson 09 on it: an answer that breaks the lesson never PASSes.
Return new arrays on every call and leave the inputs unchanged.
"""
import numpy as np  # noqa: F401  (you will want it)
from mpi4py import MPI  # noqa: F401


def route(probs, top_k, capacity):
    """Which experts each token goes to, and which of those choices fit.

    probs: (T, E) NumPy array, one group's router probabilities (each row a softmax).
    Returns (experts, keep):
      experts (T, top_k) int64: each token's top_k experts, the highest probability first;
          on a tie the lower expert index first (a stable sort of -probs does it), so
          every rank that routes the same tokens agrees.
      keep (T, top_k) bool: False where the choice is dropped. Each expert takes at most
          `capacity` choices, counting all top_k choices of all tokens made for it. It
          keeps those with the highest probability for it; on a tie, the lower token
          index. capacity None (dropless): every choice is kept.
    A dropped choice's token skips that expert: the block adds nothing for it, and the
    residual carries the token on (lesson 09's load table counts the dropped choices).
    """
    raise NotImplementedError("exercise 9.1: route")


def all_to_all_v(comm, send_chunks):
    """Send send_chunks[j] to rank j; return the N arrays received, the one from rank i at index i.

    Every chunk is an array of rows: any number of rows (0 included), every row of the same
    shape and dtype on every rank. Rank r, N ranks:
      1. counts first: at step k = 1 .. N-1, tell rank (r + k) % N how many rows it gets,
         and hear from rank (r - k) % N how many you get (one int64 each way, Sendrecv);
      2. then the rows, on the same schedule: at step k send send_chunks[(r + k) % N] and
         receive into a new array of the announced rows from (r - k) % N;
      3. your own chunk, send_chunks[r], is not sent: copy it (every array returned is new:
         none shares memory with the caller's send_chunks, which it may reuse).
    Each rank sends its rows for others once, plus N-1 counts: what lesson 09 measures
    beside its formula.
    """
    raise NotImplementedError("exercise 9.2: all_to_all_v")
