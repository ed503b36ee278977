"""all_reduce(algorithm=): one entry to every all-reduce of this package, by name.

It sits above the modules whose algorithms it names (collectives.py's ring and MPI's own,
basic.py's naive one, algorithms.py's lg N ones, tuning.py's choice for "auto") and
imports them at module level; none of them imports this one, so the imports go one
way. (This package's own layering; `minidist.comm.all_reduce` re-exports it.)
"""
from minidist.comm.algorithms import rabenseifner_all_reduce, recursive_doubling_all_reduce
from minidist.comm.basic import naive_all_reduce
from minidist.comm.checks import exchange
from minidist.comm.collectives import mpi_all_reduce, ring_all_reduce
from minidist.comm.staging import asarray, staged
from minidist.comm.tuning import choose

ALGORITHMS = ("ring", "naive", "recursive_doubling", "rabenseifner", "auto", "mpi")

# The hand-written ones by name (a module-level table: the grader, which puts a student's
# function wherever the package's answer is held, finds it here too).
_IMPLS = {"ring": ring_all_reduce, "naive": naive_all_reduce,
          "recursive_doubling": recursive_doubling_all_reduce,
          "rabenseifner": rabenseifner_all_reduce}


@staged
def all_reduce(comm, x, op="sum", algorithm="ring", check=True, impl=None):
    """All-reduce by one of the algorithms: ring, naive, recursive_doubling, rabenseifner,
    auto or mpi (`impl=` is this argument's older name).

    "auto" picks ring, Rabenseifner or recursive doubling by the alpha-beta model, from
    the message's bytes, N and this machine's measured constants (minidist/comm/tuning.py);
    every rank picks the same. The default stays "ring", the algorithm every strategy and
    lesson was checked with: the others add the ranks' arrays in another order (pairs of
    neighbours, then pairs of pairs, where the ring adds around the circle), so their
    float results differ from the ring's in the last bits, about one unit in the last
    place of the largest value per addition; integer sums are the same.
    """
    algorithm = impl if impl is not None else algorithm
    if algorithm == "auto":
        if check:   # agree on the input first: inputs of different sizes could pick differently
            exchange(comm, asarray(x), "auto_all_reduce", op=op)
            check = False
        algorithm = choose(comm, asarray(x).nbytes)
    if algorithm == "mpi":
        if check:
            exchange(comm, asarray(x), "mpi_all_reduce", op=op)
        return mpi_all_reduce(comm, x, op)
    if algorithm not in _IMPLS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r}")
    return _IMPLS[algorithm](comm, x, op=op, check=check)
