"""Lesson 06: FSDP. ZeRO stage 3 unit by unit: each rank keeps 1/N of every unit's
weights, gathers a unit just before it computes and frees it just after; the run must
still equal one process training on the whole batch.

    mpirun -n 4 python -m minidist.lessons.06_fsdp
    mpirun -n 4 python -m minidist.lessons.06_fsdp --no-reshard --no-prefetch
    mpirun -n 3 python -m minidist.lessons.06_fsdp --grad-accum 2 --json out.json

It trains a few AdamW steps (clipping by the global norm of the shards) from the same
seed as a single-process reference and compares the losses, each rank's shard of the raw
gradients of every step and of the final weights. Then: the last micro-batch's timeline
of units (gather, compute, free, prefetch, reduce-scatter), the peak of parameter bytes
per rank measured from the arrays beside "my shards + the root + one block (two while
a prefetch flies)", and the bytes sent beside (N-1)/N x (3 Psi - root).
"""
import textwrap
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel.fsdp import FSDP
from minidist.parallel.zero import expected_sent, reference_slice
from minidist.plan.memory import engine_state_bytes, fsdp_gathered_units
from minidist.plan.traffic import zero_bytes
from minidist.tensor import MEMORY
from minidist.train import TrainConfig

MARK = {"gather": "G", "gather (backward)": "G", "wait": "W", "reduce-scatter": "R"}


def make_run(args, cfg):
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    model = GPT(cfg, seed=args.seed)
    return model, model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2)), tc


def last_micro_batch(events):
    """The events since the root unit was last gathered: the last micro-batch's forward and backward."""
    starts = [i for i, (u, what, _, _) in enumerate(events) if u == 0 and what == "gather"]
    return events[starts[-1]:] if starts else events


def draw_units(events, names, width=60):
    """One row per unit: G gathered (blocking), W waited for a prefetch, - held (its compute
    runs, or it waits for the next), R its gradients reduce-scattered, p a prefetch started,
    . freed. A unit's compute can take less than one cell (a block's forward here is about
    a millisecond, a cell span/width): the cell after its gather is drawn "-" all the same,
    or the gather's last cell would swallow it."""
    t0, t1 = events[0][2], max(e[3] for e in events)
    span = max(t1 - t0, 1e-9)
    col = lambda t: min(width - 1, int((t - t0) / span * width))   # noqa: E731
    rows = {u: [" "] * width for u in range(len(names))}
    held = {}
    for u, what, a, b in events:
        row = rows[u]
        if what in MARK:
            for c in range(col(a), col(b) + 1):
                row[c] = MARK[what]
            if what != "reduce-scatter":
                held[u] = col(b) + 1
        elif what == "prefetch":
            row[col(a)] = "p"
        elif what == "free":                      # a compute shorter than one cell still gets its "-"
            start = held.pop(u, None)
            end = col(a) if start is None else min(width - 1, max(col(a), start + 1))
            for c in range(col(a) if start is None else start, end):
                row[c] = "-" if row[c] == " " else row[c]
            row[end] = "."
    for u, c in held.items():                     # gathered to the end (no resharding)
        for k in range(c, width):
            rows[u][k] = "-" if rows[u][k] == " " else rows[u][k]
    for u, name in enumerate(names):
        say(f"  {name:<9}|{''.join(rows[u])}|")
    say(f"  {'':<9} 0 ms{'':>{width - 12}}{span * 1e3:6.1f} ms")
    say("  G gather  W wait for a prefetch  p prefetch starts  - gathered (its forward or backward runs;\n"
        f"  at least one cell, {span * 1e3 / width:.1f} ms, even if shorter)  R reduce-scatter of its "
        "gradients  . freed")


# ------------------------------------------------------------------------------------- 1. the setup

def setup(args):
    """The batch rows and data, the run described: the lesson's state, which the sections below
    read and add to."""
    comm = harness.comm_world()
    rank, world = comm.Get_rank(), comm.Get_size()
    cfg = common.config_from_args(args, world)
    rows = common.batch_rows(args, rank, world)
    data = common.load_dataset(args, comm)
    say(f"Lesson 06: FSDP on {world} ranks, reshard after forward {'on' if args.reshard else 'off'}, "
        f"prefetch {'on' if args.prefetch else 'off'}\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} {cfg.dtype}; global batch "
        f"{args.batch_size} = {world} ranks x {args.batch_size // world}"
        + (f" as {args.grad_accum} micro-batches" if args.grad_accum > 1 else ""))
    return SimpleNamespace(args=args, comm=comm, world=world, cfg=cfg, rows=rows, data=data)


# ----------------------------------------------------------------------- 2. one process and the run

def train_both(run):
    """The reference (one process, the whole batch), then FSDP on every rank, its traffic counted."""
    args, cfg, comm, data = run.args, run.cfg, run.comm, run.data
    ref_model, ref_opt, tc = make_run(args, cfg)
    run.ref_losses, run.ref_full, _ = common.train_and_collect(ref_model, ref_opt, data, args, tc,
                                                               micro=args.grad_accum)
    run.model, opt, _ = make_run(args, cfg)
    run.fsdp = fsdp = FSDP(run.model, opt, comm, reshard_after_forward=args.reshard, prefetch=args.prefetch)
    run.units = fsdp.units
    MEMORY.reset_peak()
    with stats.measure() as run.meas:
        losses, run.state, run.times = common.train_and_collect(run.model, fsdp, data, args, tc, run.rows,
                                                                args.grad_accum, fsdp)
    run.state["loss"] = common.mpi_reduce(comm, losses, "sum") / run.world


def compare_section(run):
    """Each rank's shards against the same elements of the reference (nothing gathered back), and
    the last micro-batch's units drawn."""
    comm, cfg, state, units = run.comm, run.cfg, run.state, run.units
    ref = {k: reference_slice(k, run.ref_full) for k in state if k != "loss"}
    ref["loss"] = np.array(run.ref_losses)
    rel, abs_diff, _ = harness.compare(state, ref)
    run.rel, run.abs_diff = common.mpi_reduce(comm, [rel, abs_diff])
    run.tol = tol = harness.TOLERANCE[cfg.dtype]

    say(textwrap.fill(f"units   {len(units.groups)}: " + ", ".join(f"{n} {g.n:,}" for n, g in zip(units.names, units.groups))
                      + " parameters;", harness.WIDTH, subsequent_indent=" " * 8, break_long_words=False)
        + "\n        each rank keeps 1/N of each (numpy.array_split of the unit's flat buffer)")
    common.report_comparison(comm, "FSDP", run.ref_losses, state["loss"], state, ref, tol,
                             loss_label=f"loss FSDP {run.world} ranks",
                             notes=["each rank's shard \"NAME[a:b]\" against elements a:b of the reference's NAME\n"
                                    "    (nothing gathered back)"])
    say(f"  tolerance {tol:.0e} ({cfg.dtype}) per tensor: {'all within' if run.rel <= tol else 'OUTSIDE'}")

    say("\nthe last micro-batch on rank 0, unit by unit (forward goes down the blocks, backward comes back up)")
    draw_units(last_micro_batch(units.events), units.names)


# ------------------------------------------------------------------------------ 3. parameter memory

def memory_section(run):
    """Parameter memory per rank, measured from the arrays, beside the rule."""
    args, comm, units, world = run.args, run.comm, run.units, run.world
    run.item = item = np.dtype(run.cfg.dtype).itemsize
    sizes = [g.n * item for g in units.groups]
    shards = sum(g.shard.nbytes for g in units.groups)
    alive = fsdp_gathered_units(sizes, args.reshard, args.prefetch)    # the rule's units at the peak
    run.formula_gathered = formula_gathered = sum(alive)
    if args.reshard:
        held = len(alive) - 1
        rule = f"root {fmt_bytes(sizes[0])} + {held} block{'s' if held > 1 else ''} x {fmt_bytes(alive[1])}"
    else:
        rule = "every unit: nothing is freed until its backward"
    run.peak_gathered = peak_gathered = int(common.mpi_reduce(comm, units.peak))
    run.shards = shards = int(common.mpi_reduce(comm, shards))
    run.psi = psi = sum(g.n for g in units.groups)
    run.shards_formula = shards_formula = engine_state_bytes(3, psi, world, item)["params"]     # Psi/N
    plain = engine_state_bytes(0, psi, world, item)["params"]              # Psi, every rank
    say("\nparameter memory per rank (the largest over ranks), measured from the arrays | formula")
    harness.table([
        ["my shards (kept)", fmt_bytes(shards), f"{fmt_bytes(shards_formula)}  Psi/N = {psi:,} x {item} B / {world}"],
        ["gathered, at the peak", fmt_bytes(peak_gathered), f"{fmt_bytes(formula_gathered)}  {rule}"],
        ["peak", fmt_bytes(shards + peak_gathered), f"{fmt_bytes(shards_formula + formula_gathered)}  "
                                                   f"(plain data parallelism: {fmt_bytes(plain)})"],
    ], header=["", "measured", "formula"])


# --------------------------------------------------------------------------------- 4. communication

def comm_section(run):
    """Bytes sent per step: measured, the ring's exact count, and the paper's 3 Psi less the root
    unit."""
    args, comm, psi, item = run.args, run.comm, run.psi, run.item
    run.sent = sent = {c: int(common.mpi_reduce(comm, run.meas.bytes_sent(c) // args.steps))
                       for c in ("reduce_scatter", "all_gather")}
    run.exact = exact = {c: int(common.mpi_reduce(comm, v))
                         for c, v in expected_sent(run.fsdp, args.grad_accum).items()}
    run.root = root = run.units.groups[0].n
    run.paper = paper = zero_bytes(3, psi, run.world, item, args.grad_accum, root, args.reshard)
    k = f"{args.grad_accum} x " if args.grad_accum > 1 else ""
    term = "3 Psi - root" if args.reshard else "2 Psi"
    say(f"\ncommunication per step per rank, bytes sent (Psi = {psi:,}, root = {root:,} parameters)")
    say(f"  measured {sum(sent.values()):>12,}  " + ", ".join(f"{c} {v:,}" for c, v in sent.items()))
    say(f"  ring     {sum(exact.values()):>12,}  the ring's chunk-by-chunk count"
        + ("  equal" if sent == exact else "  DIFFERS"))
    say(f"  formula  {paper:>12,.0f}  (N-1)/N x {k}({term}) x {item} B")
    if args.reshard:
        say("  3 Psi: gather for forward, gather again for backward, reduce-scatter the gradients. Less the root:\n"
            "  the root unit stays gathered from forward to backward, because the head tied to wte is backward's\n"
            "  first op, so freeing it would only mean gathering it again at once (PyTorch's FSDP keeps its\n"
            "  root too).")
    else:
        say("  2 Psi: without resharding each unit is gathered once and kept until its backward\n"
            "  (more memory, less traffic).")


# ------------------------------------------------------------------------------------ 5. the report

def report_section(run):
    """The step time, the figures and the verdict."""
    args, comm, units, sent, exact = run.args, run.comm, run.units, run.sent, run.exact
    shards, peak_gathered, formula_gathered = run.shards, run.peak_gathered, run.formula_gathered
    step_time = common.mpi_reduce(comm, float(np.median(run.times)))
    say(f"\ntraining step: median {step_time * 1e3:.1f} ms (the slowest rank)")
    gather_ok = sent == exact
    memory_ok = peak_gathered == formula_gathered
    if not memory_ok:
        say(f"  gathered parameters at the peak {peak_gathered:,} B, the rule says {formula_gathered:,} B: DIFFERS")
    freed = all(p.data.size == 0 for p in run.model.parameters())
    if not freed:
        say("  gathered parameters still alive after the step: NOT FREED")
    match = bool(run.rel <= run.tol and gather_ok and memory_ok and freed)
    mem = {"params": shards + peak_gathered, "grads": int(common.mpi_reduce(comm, run.fsdp.peak_grad_bytes)),
           "optimizer": int(common.mpi_reduce(comm, run.fsdp.state_bytes())),
           "activations_peak": int(common.mpi_reduce(comm, MEMORY.peak_bytes))}
    figures = {"params_shards_measured": shards, "params_shards_formula": run.shards_formula,
               "params_gathered_peak_measured": peak_gathered, "params_gathered_peak_formula": formula_gathered,
               "params_peak_measured": shards + peak_gathered,
               "params_peak_formula": run.shards_formula + formula_gathered,
               "bytes_sent": sum(sent.values()), "bytes_ring": sum(exact.values()), "bytes_paper": run.paper,
               "psi": run.psi, "root_params": run.root, "units": len(units.groups)}
    return harness.new_report(
        "06_fsdp", args, parallel={"dp": run.world, "tp": 1, "pp": 1, "fsdp_units": len(units.groups),
                                   "reshard_after_forward": bool(args.reshard), "prefetch": bool(args.prefetch),
                                   "grad_accum": args.grad_accum},
        match=match, max_rel_diff=run.rel, max_abs_diff=run.abs_diff, tolerance=run.tol,
        losses={"reference": run.ref_losses, "parallel": list(run.state["loss"])},
        comm={"bytes_sent": sent, "expected_bytes": exact}, memory=mem, step_time_s=step_time, figures=figures)


def main(args):
    run = setup(args)
    train_both(run)
    compare_section(run)
    memory_section(run)
    comm_section(run)
    return harness.finish(report_section(run), args)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=4, n_head=4, n_embd=64, block_size=32, batch_size=24)
    p.add_argument("--reshard-after-forward", dest="reshard", action="store_true", default=True,
                   help="free each block after its forward, gather it again for backward (default)")
    p.add_argument("--no-reshard", dest="reshard", action="store_false",
                   help="keep each unit gathered from its forward until its backward")
    p.add_argument("--prefetch", dest="prefetch", action="store_true", default=True,
                   help="start the next unit's all-gather while this one computes (default)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="gather each unit when it is needed")
    common.add_step_flags(p, grad_accum=True)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
