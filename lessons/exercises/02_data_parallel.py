"""Exercise 02: the two ideas of data parallelism, by hand.

Every rank holds the whole model and computes gradients on its own slice of the global
batch; averaging the gradients over ranks gives exactly the gradient of the whole batch.
Replace each `raise` with your code, then grade your file under MPI at 3 ranks and at 4
(every rank runs the checks; the verdicts are agreed; a deadlock is reported as FAIL after
a time limit; below 3 ranks exercise 2.1 fails and says so):

    mpirun -n 3 python -m minidist.grade lessons/exercises/02_data_parallel.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/02_data_parallel.py

The package's answers are in minidist/parallel/data_parallel.py under the same names
(assign_buckets is imported there from minidist/plan/rules.py, where the planner uses it too).
When a function passes its checks, the grader puts it into the package and runs lesson 02
with it at a tiny size (average_gradients in its --naive run, assign_buckets in its
bucketed one), in float64 and float32: it must match one process there too.
"""
import numpy as np  # noqa: F401  (you will want it)

from minidist.comm import ring_all_reduce  # noqa: F401  (use the hand-written ring, not comm.Allreduce)


def average_gradients(comm, grads):
    """The mean of each gradient over all ranks of `comm`.

    grads: a list of NumPy arrays, the same shapes on every rank (one per parameter).
    Return a new list of arrays of the same shapes: element-wise (g_0 + g_1 + ... ) / N,
    where g_r is rank r's array and N = comm.Get_size(), each of its gradient's dtype
    (float32 stays float32) and new on every call. Leave the inputs unchanged.
    Use ring_all_reduce(comm, x, op="sum") for the communication: the grader checks that
    the bytes went through minidist's own ring, and the communicator it hands you refuses
    MPI's collectives (comm.Allreduce). Divide into new arrays: `g /= N` would change the
    caller's gradient. The grader also calls it on communicators of other sizes (a group of
    N-1 ranks, and one rank alone), so N must come from comm.Get_size(), never from a number.
    """
    raise NotImplementedError("exercise 2.1: average_gradients")


def assign_buckets(nbytes, bucket_bytes):
    """Group parameters into buckets the way PyTorch DDP does.

    nbytes: the size in bytes of each parameter's gradient, in the model's parameter order.
    Return a list of buckets, each a list of parameter indices, first bucket first:
    walk the parameters from the LAST to the first (backward produces the gradients of the
    last layers first, so the first bucket is ready early), add each to the open bucket,
    and close the bucket as soon as it holds at least bucket_bytes. The last bucket may
    be smaller. Example: nbytes [100, 200, 50, 300], bucket_bytes 250 -> [[3], [2, 1], [0]].
    Return new lists on every call.
    """
    raise NotImplementedError("exercise 2.2: assign_buckets")
