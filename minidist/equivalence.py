"""Is the parallel run the one-process run? The two are trained alike and compared tensor by tensor.

The reference (one process, whole global batch) and every parallel run go through
`train_and_collect`, so they see the same batches, schedule and dropout masks; the only
difference left is the strategy under test. What they are compared on is the rule of
`COMPARED`: losses, the raw gradients of every step (before clipping and the optimizer)
and the final weights. `compare` takes the worst tensor's max_rel_diff, held to
`TOLERANCE`; lessons, tests and the grader all judge with it.
"""
import math
import time

import numpy as np

from minidist import transfers
from minidist.backend import to_numpy
from minidist.train import get_lr, micro_batches, train_step

# Tolerances on max_rel_diff (per tensor: max|a-b| / max|b|). float64 sums in another
# order differ in the last bits (~1e-16 relative) and a few steps of training amplify
# that a little; 1e-10 leaves a margin of a million while still catching any real bug.
# float32 carries ~6e-8 relative rounding per op; after a few AdamW steps (which divide
# by sqrt(v), amplifying small-gradient noise) parallel and serial orders differ by up
# to ~1e-4 on individual tensors (data parallel, 3 steps: 3e-5 to 1.2e-4 measured at 3
# and 4 ranks), so float32 is held to 1e-3.
TOLERANCE = {"float64": 1e-10, "float32": 1e-3}


def rel_diff(a, b):
    """(max|a-b| / max|b|, max|a-b|) for one tensor; (0, 0) when both are all zero.

    A NaN or inf on either side is infinitely wrong, never quietly skipped. A device array
    is brought home first (to_numpy: a counted copy); comparisons are host work.
    """
    a = np.asarray(to_numpy(a), dtype=np.float64)
    b = np.asarray(to_numpy(b), dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0, 0.0
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf"), float("inf")
    abs_diff = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b)))
    if scale == 0.0:
        return (0.0 if abs_diff == 0.0 else float("inf")), abs_diff
    return abs_diff / scale, abs_diff


def compare(parallel, reference):
    """Compare two {name: array} dicts tensor by tensor.

    Returns (max_rel_diff, max_abs_diff, worst_name). A name missing from one side is a
    mismatch (inf), never silently skipped.
    """
    worst_rel, worst_name, max_abs = 0.0, None, 0.0
    for name in sorted(set(parallel) | set(reference)):
        if name not in parallel or name not in reference:
            return float("inf"), float("inf"), name
        r, a = rel_diff(parallel[name], reference[name])
        max_abs = max(max_abs, a)
        if worst_name is None or r > worst_rel:
            worst_rel, worst_name = r, name
    return worst_rel, max_abs, worst_name


# What every training lesson compares, in the words its report prints. The gradients are
# the raw ones: a gradient off by a constant factor (an average divided by N-1 instead of
# N, a micro-batch loss not scaled by 1/k, a tensor-parallel sum counted twice) is the
# most common bug of a parallel strategy, and gradient clipping followed by AdamW hides
# it from the weights: clipping rescales the gradients to one norm, and AdamW divides
# each by its own running size. Before clipping and before the optimizer, the factor is
# in plain sight.
COMPARED = (
    "the loss of every step",
    "the raw gradients of every step: synchronised across ranks, before clipping and the optimizer\n"
    "    (clipping and AdamW both rescale gradients: a gradient off by a constant factor would still\n"
    "    give the right weights, so the gradients are compared before they do)",
    "every weight after the last step",
)

KINDS = (("losses", "loss"), ("raw gradients", "grad:"), ("weights", "weight:"))


def train_and_collect(model, opt, data, args, tc, rows=slice(None), micro=1, dp=None):
    """Train `args.steps` steps on rows `rows` of each global batch; return what to compare.

    Every run, reference or parallel, goes through here, so both see the same batches
    (data.get_batch is a function of the step), the same learning-rate schedule and the
    same dropout masks (drawn per sample of the global batch). Returns
    (local losses per step, state, step times), where state holds
    - "grad:<name>@step<s>": the raw gradient of step s, as train_step's dp slot left it
      (synchronised across ranks, scaled by the micro-batches, not yet clipped; zeros
      for a parameter without one), see COMPARED for why;
    - "weight:<name>": the weights after the last step.
    """
    losses, times, state, moved = [], [], {}, 0
    for step in range(args.steps):
        x, y = data.get_batch("train", args.batch_size, step)
        first = rows.start or 0
        batches = micro_batches(x[rows], y[rows], step, args.seed, micro, first_sample=first)
        raw = {}
        before = transfers.snapshot()
        t0 = time.perf_counter()
        loss, _ = train_step(model, opt, batches, get_lr(step, tc), tc.grad_clip, dp=dp, raw_grads=raw)
        times.append(time.perf_counter() - t0)
        moved += host_device_bytes(before)
        losses.append(loss)
        # a sharded run (ZeRO) names the pieces of the gradient it holds: "NAME[a:b]"
        held = dp.named_grads(model) if dp is not None else model.named_parameters()
        for name, p in held:
            g = raw[name]
            state[f"grad:{name}@step{step}"] = np.zeros(p.shape, p.dtype) if g is None else to_numpy(g)
    for name, p in (dp.named_weights(model) if dp is not None else model.named_parameters()):
        state[f"weight:{name}"] = to_numpy(p.data).copy()
    record_run(moved, args.steps, strategy=dp is not None)
    return losses, state, times

# ----------------------------------------------------------------------------- host <-> device bytes

# The training runs of this process: (strategy?, host<->device bytes, steps). Only the bytes
# of the training steps count (token ids in, the loss out, what a strategy stages through
# the host); the copies train_and_collect makes to compare (gradients, weights) do not.
RUNS = []


def host_device_bytes(before):
    """h2d + d2h bytes since `before` (a transfers.snapshot()); always 0 on the CPU."""
    now = transfers.snapshot()
    return (now["h2d"] - before["h2d"]) + (now["d2h"] - before["d2h"])


def record_run(nbytes, steps, strategy=True):
    """Note one training run's host<->device bytes (a lesson that trains without
    train_and_collect records its own); strategy False: the one-process reference."""
    RUNS.append((bool(strategy), int(nbytes), int(steps)))


def host_device_bytes_per_step():
    """Bytes per step of the last run with a strategy (the last run when none had one);
    None when this process trained nothing."""
    runs = [r for r in RUNS if r[0]] or RUNS
    if not runs:
        return None
    _, nbytes, steps = runs[-1]
    return nbytes / max(1, steps)


def compare_by_kind(state, ref_state):
    """compare() for each kind of KINDS apart: [(kind, max_rel_diff, max_abs_diff, worst key)].

    A kind present on neither side (a lesson that does not train has no gradients) is left out.
    """
    out = []
    for kind, prefix in KINDS:
        keys = [k for k in set(state) | set(ref_state) if k.startswith(prefix)]
        if not keys:
            continue
        part = lambda d: {k: d[k] for k in keys if k in d}   # noqa: E731  (missing -> inf in compare)
        out.append((kind, *compare(part(state), part(ref_state))))
    return out


def gradient_factor(state, ref_state, step=0):
    """How far step `step`'s raw gradients are one constant multiple of the reference's.

    Returns (c, residual): c = <g, g_ref> / <g_ref, g_ref> over every gradient of that
    step (the least-squares factor), residual = |g - c g_ref| / |g_ref|. A residual near
    0 with c != 1 is the signature of a scaling bug (an average over the wrong count, a
    missing 1/k); (None, None) when there is nothing to compare.
    """
    keys = [k for k in ref_state if k.startswith("grad:") and k.endswith(f"@step{step}") and k in state]
    ref = [np.asarray(ref_state[k], np.float64).ravel() for k in keys]
    par = [np.asarray(state[k], np.float64).ravel() for k in keys]
    rr = sum(float(r @ r) for r in ref)
    if not keys or rr == 0.0:
        return None, None
    c = sum(float(p @ r) for p, r in zip(par, ref)) / rr
    res = math.sqrt(sum(float((p - c * r) @ (p - c * r)) for p, r in zip(par, ref)) / rr)
    return c, res


def where(key):
    """A state key in words: "grad:transformer.wte.weight@step2" -> "transformer.wte.weight at step 2"."""
    name = key.split(":", 1)[1] if ":" in key else key
    if "@step" in name:
        name, step = name.rsplit("@step", 1)
        return f"{name} at step {step}"
    return name


def mpi_reduce(comm, values, op="max"):
    """Reduce numbers across ranks with MPI's own Allreduce of a float64 buffer.

    For the report (losses, largest differences, bytes): these small messages are not
    part of what a lesson measures, so they bypass minidist.comm and its counters.
    """
    from mpi4py import MPI
    buf = np.array(values, dtype=np.float64)
    out = np.empty_like(buf)
    comm.Allreduce(buf, out, op={"max": MPI.MAX, "sum": MPI.SUM}[op])
    return out if buf.ndim else float(out)
