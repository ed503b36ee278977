"""Checks for lessons/exercises/06_fsdp.py: a unit's gather and its free (stage 3's
gather-compute-free step), run on every rank under mpirun.

Every rank builds the same units: small MLPs (seeded parameters of uneven sizes) in
float64 and in float32, whose totals (82, 73, 82 again with other values) no world
size from 3 to 8 divides, and whose remainders leave two ranks or more with the shorter
piece: padding each shard to equal length then falls between shards, not only at the
end. Each unit is a zero.Group with shards, freed as stage 3 starts.

6.1 calls gather_params once per unit (three calls) with a CountingComm (refuses MPI's
collectives, counts bytes): the buffer it returns must be the unit's dtype and hold
the shards in rank order, each parameter a view of it with its original values; the
check computes with them (the MLP forward) against the same product of the originals,
holds the gather to one ring all-gather's bytes (all but my right neighbour's piece),
and after the later calls checks that the earlier units still hold their values (a
buffer reused per size would not). Then the package's free_params: every buffer must be
gone (the check holds it only through a weakref, and gc.collect()), or FSDP would free
nothing.

6.2 gathers each unit with the package's gather_params and calls free_params (three
calls): every parameter must point at an empty array of the unit's dtype, the gathered
buffer must be gone, no message sent, and the shard untouched: the check gathers the
unit again after each free, and the values must be the originals. Units freed earlier
must stay freed.

The expected values (the originals) are made again from their seeds after the
function under grade has returned, never held in a frame it could read while it runs.
An AssertionError raised by the student's own code is reported as such.
"""
import gc
import weakref

import numpy as np

from minidist.grader.checks import Exercise, own_session, yours as _yours
from minidist.grader.plugin import Run
from minidist.nn import Parameter
from minidist.parallel import fsdp
from minidist.plan.collectives import ring_all_gather_sent
from minidist.parallel.zero import Group

REFUSE = "use ring_all_gather(comm, group.shard) from minidist.comm: this exercise gathers on the ring"
# (seed, dtype, (inputs, hidden, outputs)): an MLP of I*H + H + H*O + O values
UNITS = [(11, np.float64, (5, 7, 5)),     # 82 values
         (12, np.float32, (6, 7, 3)),     # 73
         (13, np.float64, (5, 7, 5))]     # 82 again, other values: a buffer reused per size is overwritten


def _shapes(i, h, o):
    return [("fc.weight", (i, h)), ("fc.bias", (h,)), ("proj.weight", (h, o)), ("proj.bias", (o,))]


def _originals(seed, dtype, dims):
    """The unit's values, made from its seed: the same on every rank, and made again to compare."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _, shape in _shapes(*dims)]


def _unit(comm, seed, dtype, dims):
    named = [(name, Parameter(v)) for (name, _), v in zip(_shapes(*dims), _originals(seed, dtype, dims))]
    group = Group(named, comm, shard=True)
    fsdp.free_params(group)                           # start as stage 3 does: only my shard
    return group


def _x(seed, dtype, dims):
    return np.random.default_rng(seed + 100).standard_normal((4, dims[0])).astype(dtype)


def _mlp(params, x):
    w1, b1, w2, b2 = params
    return np.tanh(x @ w1 + b1) @ w2 + b2


def _data(rank, name, p, what):
    """p.data as an array, or a sentence saying what it is instead."""
    data = getattr(p, "data", None)
    if not isinstance(data, np.ndarray):
        raise AssertionError(f"rank {rank}: after {what}, {name}.data is "
                             f"{'None' if data is None else 'a ' + type(data).__name__}, not an array: "
                             + ("point it at an empty array of the unit's dtype, np.empty(0, group.dtype) "
                                "(the model reads a freed parameter's shape and dtype)" if "free" in what else
                                "group.point(full) makes each parameter a view of its part of the buffer"))
    return data


def _what(full, want, size):
    """What a wrong buffer is: None, its length, or where its values go wrong."""
    if full is None:
        return "None"
    got = np.asarray(full)
    if got.shape != want.shape:
        pad = " (shards padded to equal length?)" if got.size > want.size else ""
        return f"an array of shape {got.shape}{pad}"
    i = int(np.flatnonzero(got.reshape(-1) != want)[0])
    starts = [int(a[0]) if a.size else None for a in np.array_split(np.arange(want.size), size)]
    k = max(r for r, a in enumerate(starts) if a is not None and a <= i)
    at = "the first element" if i == starts[k] else f"element {i - starts[k]}"
    return f"{got.size} values, wrong from element {i} on ({at} of rank {k}'s shard)"


def _gathered_ok(group, originals, full, rank, what):
    for name, p, want in zip(group.names, group.params, originals):
        got = _data(rank, name, p, what)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise AssertionError(f"rank {rank}: after {what}, {name} has shape {got.shape} and "
                                 f"{'other values' if got.shape == want.shape else 'not its own'}; expected its "
                                 f"original {want.shape} values (group.point(full) makes each parameter a view)")
        if got.dtype != want.dtype:
            raise AssertionError(f"rank {rank}: after {what}, {name} is {got.dtype} in a {want.dtype} unit: "
                                 "keep the unit's dtype")
        if full is not None and not np.shares_memory(got, full):
            raise AssertionError(f"rank {rank}: {name} is not a view of the buffer gather_params returned: "
                                 "a copy per parameter holds the unit twice")


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


def check_gather_params(fn, session=None):
    with own_session(session) as s:
        rank, size = s.rank(), s.size()
        done = []                                     # (unit, group, weakref to its buffer, the buffer)
        for unit in UNITS:
            seed, dtype, dims = unit
            comm = s.counting(REFUSE)
            group = _unit(comm, *unit)
            shard = group.shard.copy()
            full = _yours(fn, comm, group)
            if comm.refused:
                raise AssertionError(comm.refused)
            if group.shard is None or group.shard.shape != shard.shape or not np.array_equal(group.shard, shard):
                raise AssertionError(f"rank {rank}: the shard was changed by the gather; it is what this rank keeps")
            # what the buffer must be, made now that fn has returned
            originals = _originals(*unit)
            want_full = np.concatenate([o.reshape(-1) for o in originals])
            call = f"gather_params on a {np.dtype(dtype).name} unit of {want_full.size} values at {size} ranks"
            if isinstance(full, np.ndarray) and full.dtype != want_full.dtype:
                raise AssertionError(f"rank {rank}: {call} returned a {full.dtype} buffer: keep the unit's dtype "
                                     f"{want_full.dtype} (group.dtype; ring_all_gather returns the shards' own "
                                     "dtype, np.zeros(n) is float64)")
            if full is None or np.asarray(full).shape != want_full.shape or not np.array_equal(full, want_full):
                raise AssertionError(f"rank {rank}: {call} returned {_what(full, want_full, size)}; gather_params must "
                                     f"return the unit's whole flat buffer of {want_full.size} values, the shards "
                                     "joined in rank order (each as it is, pieces may differ by one)")
            _gathered_ok(group, originals, full, rank, "gather_params")
            x = _x(*unit)
            if not np.array_equal(_mlp([p.data for p in group.params], x), _mlp(originals, x)):
                raise AssertionError(f"rank {rank}: computing with the gathered unit differs from the original")
            expected = ring_all_gather_sent(group.n, 1, size, rank) * want_full.itemsize
            if comm.bytes_sent != expected:
                raise AssertionError(f"rank {rank}: sent {comm.bytes_sent} bytes to gather {group.n} values on {size} "
                                     f"ranks; one ring all-gather sends {expected} (all but my right neighbour's "
                                     "piece, each shard as it is: no padding)")
            done.append((unit, group, _ref(full), full))
            del full, originals, want_full
        for i, (unit, group, _, full) in enumerate(done):     # every earlier unit: still its own values
            later = len(done) - 1 - i
            try:
                _gathered_ok(group, _originals(*unit), full, rank, f"gather_params and {later} later gathers"
                             if later else "gather_params")
            except AssertionError as e:
                raise AssertionError(f"{e}; the earlier units' buffers must stay as they were when gather_params is "
                                     "called again (a new buffer per call, not one reused)") from None
        refs = [ref for _, _, ref, _ in done]
        groups = [group for _, group, _, _ in done]
        done = full = None
        for group, ref in zip(groups, refs):
            fsdp.free_params(group)                   # the package's free: this checks that nothing else holds it
            _freed(ref, rank, "the buffer gather_params returned", "gather_params kept a reference to it (in the "
                   "group, a global, a list): only the parameters' views may hold it")


def check_free_params(fn, session=None):
    with own_session(session) as s:
        rank = s.rank()
        groups = []
        for unit in UNITS:
            comm = s.counting(REFUSE)
            group = _unit(comm, *unit)
            groups.append(group)
            full = fsdp.gather_params(comm, group)    # the package's gather: this checks the free only
            sent = comm.bytes_sent
            _mlp([p.data for p in group.params], _x(*unit))   # compute, then free
            ref = _ref(full)
            del full                                  # the check holds the buffer no more: only the parameters do
            shard = group.shard.copy()
            _yours(fn, group)
            _free_ok(group, ref, rank)
            if comm.bytes_sent != sent:
                raise AssertionError(f"rank {rank}: free_params sent messages; freeing is local")
            if group.shard is None or group.shard.shape != shard.shape or not np.array_equal(group.shard, shard):
                raise AssertionError(f"rank {rank}: free_params changed group.shard (now "
                                     f"{'None' if group.shard is None else f'{group.shard.size} values'}, was "
                                     f"{shard.size}): the shard is what this rank keeps, the next gather is made "
                                     "from it; free only the parameters")
            try:                                      # the next gather (its forward, or its backward) must work
                fsdp.gather_params(comm, group)
                _gathered_ok(group, _originals(*unit), None, rank, "free_params and a new gather_params")
            except AssertionError:
                raise
            except Exception as e:
                raise AssertionError(f"rank {rank}: gathering the unit again after your free_params raised "
                                     f"{type(e).__name__}: {e}; free only the parameters, keep the group as it "
                                     "was") from None
            fsdp.free_params(group)
        for group in groups:                          # freed units stay freed when others are gathered and freed
            for name, p in zip(group.names, group.params):
                if _data(rank, name, p, "free_params").size:
                    raise AssertionError(f"rank {rank}: {name} of an earlier unit holds values again after later "
                                         "calls of free_params: free only the group you are given")


def _free_ok(group, ref, rank):
    """After free_params: every parameter empty, of the unit's dtype; the buffer gone."""
    for name, p in zip(group.names, group.params):
        data = _data(rank, name, p, "free_params")
        if data.size != 0:
            raise AssertionError(f"rank {rank}: after free_params, {name} still holds {data.size} values: "
                                 "point it at an empty array so the gathered buffer can go")
        buf = ref()
        if buf is not None and (np.shares_memory(data, buf) or (data.base is not None and data.base.size)):
            raise AssertionError(f"rank {rank}: {name} is empty but still keeps the gathered buffer alive")
        buf = None
        if data.dtype != group.dtype:
            raise AssertionError(f"rank {rank}: {name} became {data.dtype}; keep the unit's dtype {group.dtype} "
                                 f"(np.empty(0, group.dtype))")
    data = p = None
    _freed(ref, rank, "the gathered buffer", "free_params kept a reference to it, or to a parameter's view of "
           "it, in a global, a list or the group: point the parameters at an empty array and keep nothing")


# Lesson 06 at a small shape on the graded ranks, resharding after forward (its default)
# and without prefetch, two micro-batches per step: your gather brings every unit, for each
# micro-batch's forward and again for its backward; your free frees each after it. (With
# prefetch, the lesson's default, most blocks come by the package's non-blocking gather.)
RUNS = (Run("06_fsdp", lambda n: ("--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
                                   "--batch-size", str(2 * n), "--steps", "1", "--no-prefetch", "--grad-accum", "2")),)
WHY_RANKS = {"6.1": "from 2 shards only the last can be the shorter one, so shards padded to equal length and cut "
                    "back to group.n come out right; from 3 or more the padding falls between shards;",
             "6.2": "free_params is checked between gathers of units cut into uneven shards, the unit gathered "
                    "again from every rank's shard after your free, as 6.1 is (3 ranks or more);"}

EXERCISES = [
    Exercise("6.1", "gather_params", fsdp.gather_params, check_gather_params, 3, why_ranks=WHY_RANKS["6.1"],
             runs=RUNS),
    Exercise("6.2", "free_params", fsdp.free_params, check_free_params, 3, why_ranks=WHY_RANKS["6.2"], runs=RUNS),
]
