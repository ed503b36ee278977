"""What the training lessons share beyond the harness: model and data flags, one training
loop for the reference and the parallel runs, and small reductions for the report.

The reference (one process, whole global batch) and every parallel run go through
`train_and_collect`, so they see the same batches, schedule and dropout masks; the only
difference left is the strategy under test. What they are compared on is the rule of
`COMPARED`: losses, the raw gradients of every step (before clipping and the optimizer)
and the final weights.
"""
import math

import numpy as np

from minidist.lessons.harness import (InputError, command_with, heads_fix, need, nonnegative_float,
                                      physical_memory, positive_float, positive_int, ranks)


def add_model_flags(p, n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=8, dropout=0.0):
    """The GPT's shape, the global batch and the data: flags shared by the training lessons."""
    g = p.add_argument_group("model and data")
    g.add_argument("--n-layer", type=positive_int, default=n_layer)
    g.add_argument("--n-head", type=positive_int, default=n_head)
    g.add_argument("--n-embd", type=positive_int, default=n_embd)
    g.add_argument("--block-size", type=positive_int, default=block_size, help="sequence length T")
    g.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help="the global batch in sequences (default %(default)s)")
    g.add_argument("--dropout", type=float, default=dropout, help="dropout probability in [0, 1)")
    g.add_argument("--data", metavar="PATH", help="a UTF-8 text file (default: Python stdlib source)")
    return g


def add_step_flags(p, grad_accum=False, clip_off=True):
    """The optimizer step's flags: --lr, --grad-clip and, where the lesson accumulates,
    --grad-accum. clip_off=False: a lesson whose figures need clipping on (0 refused)."""
    if grad_accum:
        p.add_argument("--grad-accum", type=positive_int, default=1,
                       help="micro-batches per rank per step, one gradient sync per step (default %(default)s)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--grad-clip", type=nonnegative_float if clip_off else positive_float, default=0.5,
                   help="clip the global gradient norm" + (" (0: off)" if clip_off else "") + " (default %(default)s)")


def config_from_args(args, ranks=1):
    """GPTConfig from the flags; a shape that cannot work is an InputError.

    That includes a shape whose activations cannot fit in this machine's memory, split
    among the `ranks` that share it (the batch is cut among them too).
    """
    from minidist.model import GPTConfig
    need(0.0 <= args.dropout < 1.0, f"--dropout must be in [0, 1), got {args.dropout}")
    cfg = GPTConfig(block_size=args.block_size, vocab_size=256, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, dtype=args.dtype)
    try:
        cfg.validate()
    except ValueError as e:
        fix = heads_fix(cfg.n_head, cfg.n_embd)
        raise InputError(f"{e}; this works: {command_with(ranks, fix)}" if fix else str(e))
    need_bytes = activation_bytes(cfg, max(1, args.batch_size // ranks)) * ranks
    have = physical_memory()
    need(have is None or need_bytes < 0.8 * have,
         f"this shape needs about {need_bytes / 2**30:.1f} GiB for activations on {ranks} rank(s), more than "
         f"this machine's {(have or 0) / 2**30:.1f} GiB: use a smaller --block-size, --batch-size or model")
    return cfg


def batch_rows(args, rank, world):
    """This data-parallel rank's rows of the global batch; a batch that does not split over
    `world` ranks and --grad-accum micro-batches is bad input (one message, exit 2)."""
    from minidist.data import shard_slice
    try:
        return shard_slice(args.batch_size, rank, world, args.grad_accum)
    except ValueError as e:
        unit = world * args.grad_accum                     # the next batch that splits
        works = command_with(world, {"--batch-size": -(-args.batch_size // unit) * unit})
        raise InputError(f"--batch-size {args.batch_size} with {world} ranks and --grad-accum "
                         f"{args.grad_accum}: {e}; this works: {works}")


def activation_bytes(cfg, batch):
    """A rough upper bound of what one training step saves for backward, in bytes.

    Per layer: about 20 arrays of (B, T, C) (inputs of the matmuls, layer norms, GELU)
    and 2 of (B, nh, T, T) (attention probabilities and their dropout mask); then the
    (B, T, V) logits and their softmax.
    """
    B, T, C = batch, cfg.block_size, cfg.n_embd
    per_layer = 20 * B * T * C + 2 * B * cfg.n_head * T * T
    return (cfg.n_layer * per_layer + 2 * B * T * cfg.vocab_size) * np.dtype(cfg.dtype).itemsize


def load_dataset(args, comm=None):
    """The Dataset for --data (or the default corpus) at --block-size; errors -> InputError.

    With a communicator, the ranks agree first: a file missing on one node's disk stops
    every rank with the message, instead of one rank leaving while the others wait.
    """
    from minidist.data import Dataset, DataError, load_text
    from minidist.lessons.harness import agreed_need
    error, dataset = None, None
    try:
        dataset = Dataset.from_text(load_text(args.data), args.block_size, seed=args.seed)
    except DataError as e:
        error = str(e)
    if comm is not None:
        agreed_need(comm, error is None, error or f"--data {args.data} could not be read")
    elif error:
        raise InputError(error)
    return dataset


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
    import time
    from minidist.backend import to_numpy
    from minidist.train import get_lr, micro_batches, train_step
    losses, times, state = [], [], {}
    for step in range(args.steps):
        x, y = data.get_batch("train", args.batch_size, step)
        first = rows.start or 0
        batches = micro_batches(x[rows], y[rows], step, args.seed, micro, first_sample=first)
        raw = {}
        t0 = time.perf_counter()
        loss, _ = train_step(model, opt, batches, get_lr(step, tc), tc.grad_clip, dp=dp, raw_grads=raw)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        # a sharded run (ZeRO) names the pieces of the gradient it holds: "NAME[a:b]"
        held = dp.named_grads() if hasattr(dp, "named_grads") else model.named_parameters()
        for name, p in held:
            g = raw[name]
            state[f"grad:{name}@step{step}"] = np.zeros(p.shape, p.dtype) if g is None else to_numpy(g)
    for name, p in (dp.named_weights() if hasattr(dp, "named_weights") else model.named_parameters()):
        state[f"weight:{name}"] = to_numpy(p.data).copy()
    return losses, state, times


def compare_by_kind(state, ref_state):
    """harness.compare for each kind of KINDS apart: [(kind, max_rel_diff, max_abs_diff, worst key)].

    A kind present on neither side (a lesson that does not train has no gradients) is left out.
    """
    from minidist.lessons.harness import compare
    out = []
    for kind, prefix in KINDS:
        keys = [k for k in set(state) | set(ref_state) if k.startswith(prefix)]
        if not keys:
            continue
        part = lambda d: {k: d[k] for k in keys if k in d}   # noqa: E731  (missing -> inf in compare)
        out.append((kind, *compare(part(state), part(ref_state))))
    return out


def report_comparison(comm, against, ref_losses, losses, state, ref_state, tol, notes=(),
                      show_where=None, loss_label=None):
    """Print, on rank 0, what was compared and each kind's max_rel_diff (the largest over ranks).

    against: "4 ranks", "tp=8", ...; notes: lines on how the pieces were lined up (shards,
    partitions); show_where: None to leave out which tensor differs most, "" to name it,
    " on rank 0" to name rank 0's (where each rank compares its own pieces).
    """
    from minidist.lessons.harness import WIDTH, say, table
    say(f"\nwhat was compared, one process against {against}:")
    for line in COMPARED + tuple(notes):
        say(f"  - {line}")
    table([[s, f"{a:.6f}", f"{b:.6f}"] for s, (a, b) in enumerate(zip(ref_losses, losses))],
          header=["step", "loss 1 process", loss_label or f"loss {ranks(comm.Get_size())}"])
    for kind, r, _, w in compare_by_kind(state, ref_state):
        r = mpi_reduce(comm, r)
        worst = f"  (largest in {where(w)}{show_where})" if show_where is not None and ":" in w else ""
        head, verdict = f"  {kind:<13} max_rel_diff {r:.1e}", "" if r <= tol else "  OUTSIDE the tolerance"
        if len(head + worst + verdict) <= WIDTH:
            say(head + worst + verdict)
        else:                                       # the tensor's name on a line of its own
            say(head + verdict + f"\n  {'':<13} {worst.strip()}")


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
