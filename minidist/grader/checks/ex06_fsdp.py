"""Checks for lessons/exercises/06_fsdp.py: a unit's gather and its free (stage 3's
gather-compute-free step), run on every rank under mpirun.

Every rank builds the same unit (seeded parameters of uneven sizes, a total that 3, 4
and 8 do not divide) as a zero.Group with shards, frees it, and hands gather_params a
CountingComm (refuses MPI's collectives, counts bytes). After the gather each parameter
must hold its original values as a view of the one gathered buffer; the check then
computes with them (a small MLP forward) against the same product of the originals, and
calls free_params: every parameter must point at an empty array of the unit's dtype
(float32 in 6.2's unit, so that a default float64 empty array fails), and the gathered
buffer must be gone: the check holds it only through a weakref, and after free_params
and gc.collect() it must be dead (6.1 with the package's free, 6.2 with the package's
gather), or FSDP would free nothing. The gather is held to one ring all-gather's bytes (all but my right
neighbour's piece).
"""
import gc
import weakref

import numpy as np

from minidist.grader.checks import Exercise, own_session
from minidist.grader.plugin import Run
from minidist.nn import Parameter
from minidist.parallel import fsdp
from minidist.parallel.tp_formulas import ring_all_gather_sent
from minidist.parallel.zero import Group

REFUSE = "use ring_all_gather(comm, group.shard) from minidist.comm: this exercise gathers on the ring"
SHAPES = [("fc.weight", (5, 7)), ("fc.bias", (7,)), ("proj.weight", (7, 3)), ("proj.bias", (3,))]   # 67 values


def _unit(comm, dtype=np.float64):
    rng = np.random.default_rng(2024)                 # the same on every rank: one model
    named = [(name, Parameter(rng.standard_normal(shape).astype(dtype))) for name, shape in SHAPES]
    originals = [p.data.copy() for _, p in named]
    group = Group(named, comm, shard=True)
    fsdp.free_params(group)                           # start as stage 3 does: only my shard
    return group, originals


def _mlp(params, x):
    w1, b1, w2, b2 = params
    return np.tanh(x @ w1 + b1) @ w2 + b2


def _gathered_ok(group, originals, full, rank, what):
    for name, p, want in zip(group.names, group.params, originals):
        got = np.asarray(p.data)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise AssertionError(f"rank {rank}: after {what}, {name} has shape {got.shape} and "
                                 f"{'other values' if got.shape == want.shape else 'not its own'}; expected its "
                                 f"original {want.shape} values (group.point(full) makes each parameter a view)")
        if full is not None and not np.shares_memory(got, full):
            raise AssertionError(f"rank {rank}: {name} is not a view of the buffer gather_params returned: "
                                 "a copy per parameter holds the unit twice")


def check_gather_params(fn, session=None):
    with own_session(session) as s:
        rank, size = s.rank(), s.size()
        comm = s.counting(REFUSE)
        group, originals = _unit(comm)
        shard = group.shard.copy()
        full = fn(comm, group)
        if comm.refused:
            raise AssertionError(comm.refused)
        if not np.array_equal(group.shard, shard):
            raise AssertionError(f"rank {rank}: the shard was changed by the gather; it is what this rank keeps")
        want_full = np.concatenate([o.reshape(-1) for o in originals])
        if full is None or np.asarray(full).shape != want_full.shape or not np.array_equal(full, want_full):
            raise AssertionError(f"rank {rank}: gather_params must return the unit's whole flat buffer of "
                                 f"{want_full.size} values, the shards joined in rank order")
        _gathered_ok(group, originals, full, rank, "gather_params")
        x = np.random.default_rng(7).standard_normal((4, 5))
        if not np.array_equal(_mlp([p.data for p in group.params], x), _mlp(originals, x)):
            raise AssertionError(f"rank {rank}: computing with the gathered unit differs from the original")
        expected = ring_all_gather_sent(group.n, 1, size, rank) * full.itemsize
        if comm.bytes_sent != expected:
            raise AssertionError(f"rank {rank}: sent {comm.bytes_sent} bytes to gather {group.n} values on {size} "
                                 f"ranks; one ring all-gather sends {expected} (all but my right neighbour's piece)")
        ref = _ref(full)
        del full
        fsdp.free_params(group)                       # the package's free: this checks that nothing else holds it
        _freed(ref, rank, "the buffer gather_params returned", "gather_params kept a reference to it (in the group, "
               "a global, a list): only the parameters' views may hold it")


def _ref(full):
    """A weakref to the array that owns the gathered memory: `full` may itself be a view
    (a slice of the ring's buffer), and the parameters' views then hold that owner, not it."""
    while isinstance(getattr(full, "base", None), np.ndarray):
        full = full.base
    try:
        return weakref.ref(full)
    except TypeError:                                 # not an ndarray: the value checks said so already
        return lambda: None


def _freed(ref, rank, what, why):
    gc.collect()
    if ref() is not None:
        raise AssertionError(f"rank {rank}: {what} is still referenced after free_params: FSDP would free nothing "
                             f"({why})")


def check_free_params(fn, session=None):
    with own_session(session) as s:
        rank = s.rank()
        comm = s.counting(REFUSE)
        group, originals = _unit(comm, np.float32)    # float32: an empty array of the default dtype is float64
        full = fsdp.gather_params(comm, group)        # the package's gather: this checks the free only
        sent = comm.bytes_sent
        x = np.random.default_rng(7).standard_normal((4, 5)).astype(np.float32)
        _mlp([p.data for p in group.params], x)       # compute, then free
        ref = _ref(full)
        del full                                      # the check holds the buffer no more: only the parameters do
        fn(group)
        for name, p in zip(group.names, group.params):
            if p.data.size != 0:
                raise AssertionError(f"rank {rank}: after free_params, {name} still holds {p.data.size} values: "
                                     "point it at an empty array so the gathered buffer can go")
            buf = ref()
            if buf is not None and (np.shares_memory(p.data, buf) or (p.data.base is not None and p.data.base.size)):
                raise AssertionError(f"rank {rank}: {name} is empty but still keeps the gathered buffer alive")
            buf = None
            if p.data.dtype != group.dtype:
                raise AssertionError(f"rank {rank}: {name} became {p.data.dtype}; keep the unit's dtype {group.dtype} "
                                     f"(np.empty(0, group.dtype))")
        p = None
        _freed(ref, rank, "the gathered buffer", "free_params kept a reference to it, or to a parameter's view of "
               "it, in a global, a list or the group: point the parameters at an empty array and keep nothing")
        if comm.bytes_sent != sent:
            raise AssertionError(f"rank {rank}: free_params sent messages; freeing is local")


RUNS = (Run("06_fsdp", lambda n: ("--n-layer", "4", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
                                   "--batch-size", str(2 * n), "--steps", "2")),)

EXERCISES = [
    Exercise("6.1", "gather_params", fsdp.gather_params, check_gather_params, 3, runs=RUNS),
    Exercise("6.2", "free_params", fsdp.free_params, check_free_params, 3, runs=RUNS),
]
