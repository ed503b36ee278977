"""Hand-written collectives on MPI point-to-point messages, the process grid, byte counters.

    from minidist.comm import ring_all_reduce, ProcessGrid, stats

Files, in reading order:
    stats.py        bytes and messages per collective, per process
    staging.py      device arrays: staged through host buffers, or handed to MPI directly
    checks.py       the agreement check every collective makes first; agree()
    collectives.py  ring reduce-scatter (_v: pieces of the caller's lengths), ring all-gather,
                    ring all-reduce, MPI's own all-reduce
    basic.py        broadcast, reduce, the naive all-reduce
    algorithms.py   recursive-doubling and Rabenseifner all-reduces (lg N steps: small messages)
    tuning.py       algorithm="auto": the alpha-beta model's choice, calibrated on this machine
    dispatch.py     all_reduce(algorithm=): any of the above by name, above them all
    p2p.py          send / recv for pipelines, all_to_all for experts
    nonblocking.py  ring_all_reduce_start: the ring in the background, for overlap
    grid.py         ProcessGrid: tp x cp x pp x dp sub-communicators
    watchdog.py     a wait longer than MINIDIST_TIMEOUT prints every rank's stack, ends the job

This layer moves NumPy arrays, and device arrays (CuPy's, or the strict double's) the way
staging.py says, each returned in the kind it came in; it never imports the autograd
engine. Importing it in a job of several ranks starts the watchdog's thread (it wakes
twice a second).
"""
from minidist.comm import stats, watchdog
from minidist.comm.algorithms import rabenseifner_all_reduce, recursive_doubling_all_reduce
from minidist.comm.basic import broadcast, naive_all_reduce, reduce
from minidist.comm.checks import MismatchError, agree
from minidist.comm.collectives import (chunk_bounds, mpi_all_reduce, ring_all_gather,
                                       ring_all_reduce, ring_reduce_scatter, ring_reduce_scatter_v)
from minidist.comm.dispatch import all_reduce
from minidist.comm.grid import GridError, ProcessGrid
from minidist.comm.nonblocking import RingAllReduce, ring_all_reduce_start
from minidist.comm.p2p import all_to_all, all_to_all_v, recv, send

watchdog.start()

__all__ = ["stats", "agree", "MismatchError", "GridError", "ProcessGrid", "all_reduce",
           "ring_all_reduce", "ring_reduce_scatter", "ring_reduce_scatter_v",
           "ring_all_gather", "naive_all_reduce",
           "recursive_doubling_all_reduce", "rabenseifner_all_reduce", "mpi_all_reduce",
           "broadcast", "reduce",
           "all_to_all", "all_to_all_v", "send", "recv", "ring_all_reduce_start", "RingAllReduce",
           "chunk_bounds"]
