"""Exercise 05: ZeRO's two basic moves, by hand.

ZeRO cuts every flat buffer (weights, gradients, AdamW's moments) into N partitions, one
per rank, and each rank keeps only the sum of the gradient over its own partition.
Replace each `raise` with your code, then grade your file under MPI at 3 ranks and at 4:

    mpirun -n 3 python -m minidist.grade lessons/exercises/05_zero.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/05_zero.py

The package's answers, which the lesson runs, are in minidist/parallel/flat_shards.py
under the same names (zero.py re-exports them). Lesson 06's exercises
(lessons/exercises/06_fsdp.py) gather and free a unit.
"""
import numpy as np  # noqa: F401  (you will want it)

from minidist.comm import ring_reduce_scatter  # noqa: F401  (the hand-written ring, not comm.Reduce_scatter)


def partition(n, size, rank):
    """(lo, hi): the elements of a flat buffer of n values that rank `rank` of `size` owns.

    Cut exactly as numpy.array_split(range(n), size) cuts: the first n % size ranks get
    n // size + 1 elements, the others n // size; the pieces follow each other in rank
    order. Example: n=10, size=4 -> (0, 3), (3, 6), (6, 8), (8, 10). n may be smaller
    than size (some ranks get nothing: lo == hi) or 0. lo and hi are Python ints (// and
    %, or int(...) around a numpy result): the grader refuses floats and numpy integers.
    """
    raise NotImplementedError("exercise 5.1: partition")


def reduce_scatter_grad(comm, flat):
    """My partition of the mean over ranks of `flat` (ZeRO stage 2's gradient step).

    flat: this rank's gradient, a 1-D float array of the same length n on every rank.
    Return a new array: chunk `rank` of numpy.array_split(sum over ranks / N, N), where
    N = comm.Get_size(). Use ring_reduce_scatter(comm, x, op="sum"), which returns this
    rank's chunk of the sum: the grader holds you to its bytes, (n - my chunk) values, so
    an all-reduce followed by a slice (twice the bytes) fails. Leave `flat` unchanged; keep
    its dtype (the grader tries float64 and float32); return a new array on every call (the
    grader calls again with the same n and checks the earlier results did not change).
    Then lesson 05's stages 1 and 3 run on your answers.
    """
    raise NotImplementedError("exercise 5.2: reduce_scatter_grad")
