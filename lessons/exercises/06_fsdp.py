"""Exercise 06: stage 3's gather-compute-free step, by hand.

Under FSDP each rank keeps only its shard of a unit (a zero.Group built with shard=True:
`group.shard` is my piece of the unit's flat buffer, cut as exercise 5.1's partition
cuts). Just before the unit computes, the shards are gathered and the parameters pointed
at the whole; just after, they are freed. Replace each `raise` with your code, then grade
your file under MPI at 3 ranks and at 4:

    mpirun -n 3 python -m minidist.grade lessons/exercises/06_fsdp.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/06_fsdp.py

The grader calls each function on several units, in float64 and in float32, of sizes
that no world size divides (the shards differ in length by one), and checks that the
units gathered earlier keep their values; then it runs lesson 06 with your function in
the package's place, in float64 and float32. The package's answers, which lesson 06
runs, are in minidist/parallel/flat_shards.py (fsdp.py re-exports them).
"""
import numpy as np  # noqa: F401  (you will want it)

from minidist.comm import ring_all_gather  # noqa: F401  (the hand-written ring, not comm.Allgather)


def gather_params(comm, group):
    """All-gather the unit and point its parameters at the result; return the flat buffer.

    ring_all_gather(comm, group.shard) joins every rank's shard in rank order (pieces may
    differ by one element: gather them as they are, unpadded): the unit's whole flat
    buffer of group.n values, of the unit's dtype (group.dtype: a float32 unit stays
    float32). Then group.point(full) makes each parameter (group.params) a view of its
    part of it: views, not copies, so the unit is held once. A new buffer each call (the
    units gathered before keep theirs). Leave group.shard unchanged, and keep no other
    reference to the buffer (free_params must be able to free it). The grader holds you
    to one ring all-gather's bytes.
    """
    raise NotImplementedError("exercise 6.1: gather_params")


def free_params(group):
    """Free a gathered unit: point every parameter of group.params at an empty array of
    the unit's dtype (group.dtype), so nothing keeps the gathered buffer alive: an array,
    not None (the model reads a freed parameter's shape and dtype). Local: no messages.
    (The package shares one empty array per dtype.) Keep no reference to the buffer or
    its views (a global, a list, the group): the grader checks, with a weakref and
    gc.collect(), that the buffer is gone after free_params. Leave group.shard as it is:
    the next gather is made from it (the grader gathers the unit again after your free).
    """
    raise NotImplementedError("exercise 6.2: free_params")
