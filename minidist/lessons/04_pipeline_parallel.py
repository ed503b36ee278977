"""Lesson 04: pipeline parallelism. The GPT's layers are cut into stages, one per rank, and
micro-batches flow through them in a schedule; the run must equal one process.

Over 400 lines but one story: main calls named sections in order (the schedule, the run, the
comparison, the bubble, activations, point-to-point bytes, the report); the strategy lives
in minidist/parallel/schedules.py and pipeline_parallel.py.

    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel
    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --schedule gpipe --micro-batches 8
    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --schedule interleaved --chunks 2
    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --schedule interleaved --latency 0.25
    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --schedule zb-h1 --trace pipeline.json
    mpirun -n 3 python -m minidist.lessons.04_pipeline_parallel --n-layer 7 --dropout 0.1
    mpirun -n 3 python -m minidist.lessons.04_pipeline_parallel --n-layer 7 --extra-layers last
    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --pp 2 --json out.json
    MINIDIST_DEVICE=strict mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --json x.json

The schedule is data (minidist/parallel/schedules.py): the lesson draws it, simulates it
in logical time (the bubble beside its formula, peak live activations) and runs it
(minidist/parallel/pipeline_parallel.py), then compares the losses, the raw gradients of
every step and the weights with one process training the whole model on the same batch.
It prints what the real run measured beside the simulator and the formulas: the idle
fraction of every rank, the micro-batches whose activations were alive at once, and the
point-to-point bytes (b*s*h per micro-batch per boundary each way). With --pp smaller
than the world, the other factor is data parallelism (ProcessGrid). --latency gives the
simulator's messages a time (a fraction of one chunk's forward): the schedule is drawn and
its bubble simulated with it, and the interleaved schedule is shown beside the same one
without the factor 2 of its warm-up, which is what that factor buys. Under zb-h1, B computes
the input gradients and W the linears' weight gradients (a real split of the backward); the
lesson times both, runs 1F1B on a copy of the model for the same steps, and prints each one's
idle time per rank: the simulator's (with the measured F, B, W) first, then the run's.
"""
# Over 400 lines as one idea: the schedule and its run, each figure measured beside its
# simulator and formula, cut into the numbered sections main() calls in order.
import argparse
import os
import textwrap
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from minidist import equivalence
from minidist.comm import ProcessGrid, stats
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel import schedules
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.pipeline_parallel import (EXTRA_LAYERS, PipelineGPT, PipelineParallel,
                                                 expected_p2p_bytes, split_layers)
from minidist.plan.pipeline import (bubble_fraction, bubble_text, idle_time, latency_fill_drain, live_chunks,
                                    p2p_bytes, step_p2p_bytes, warmup_forwards)
from minidist.tensor import MEMORY
from minidist.train import TrainConfig

OPS = "FBW"
WIDTH = 100                                 # the pictures wrap at this many characters
MAX_LATENCY = 10                            # chunk forwards; the pictures are drawn cell by cell


def latency_value(text):
    """argparse type of --latency: a number of chunk forwards, more than 0, at most MAX_LATENCY
    (without the flag, messages take no time)."""
    v = harness.positive_float(text)
    if v > MAX_LATENCY:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_LATENCY} (forwards of one chunk: the picture is drawn cell by cell), got {v:g}")
    return v


def check_input(args, cfg, world):
    """Every rank finds the same answer: bad input ends the job with one message, exit 2."""
    pp = args.pp or world
    harness.need(pp <= world and world % pp == 0,
                 f"--pp {pp} must divide the {world} ranks of the world (the rest is data parallelism)")
    harness.need(args.chunks is None or args.schedule == "interleaved",
                 f"--chunks {args.chunks} applies to --schedule interleaved only (--schedule {args.schedule} "
                 f"gives each rank one chunk)")
    v = (args.chunks or 2) if args.schedule == "interleaved" else 1
    dp = world // pp
    if args.micro_batches is None:              # default: 8, or one sequence per micro-batch
        args.micro_batches = max(1, min(8, args.batch_size // dp))
    m = args.micro_batches
    harness.need(pp * v <= cfg.n_layer, f"{pp * v} pipeline stages" + (f" ({pp} ranks x {v} chunks)" if v > 1 else "")
                 + f" but only {cfg.n_layer} layers: every stage needs a layer (--n-layer {pp * v} or more)")
    if args.schedule == "interleaved":
        harness.need(m % pp == 0, f"interleaved 1F1B sends micro-batches in groups of {pp} (one per stage): "
                                  f"--micro-batches {m} must be a multiple of {pp}")
        harness.need(cfg.n_layer % (pp * v) == 0, f"interleaved 1F1B needs the {cfg.n_layer} layers cut into "
                                                  f"{pp} x {v} = {pp * v} equal chunks: choose --n-layer a "
                                                  f"multiple of {pp * v} (or other --chunks)")
    harness.need(args.batch_size % (dp * m) == 0,
                 f"--batch-size {args.batch_size} must split into {dp} replica(s) x {m} micro-batches of equal "
                 f"size (each micro-batch's loss counts 1/m: unequal ones would weigh samples unequally)")
    harness.need(args.lr > 0, f"--lr must be positive, got {args.lr}")
    return pp, v, dp


def stage_table(model_ranges, pp, v, n_layer):
    rows = []
    for r in range(pp):
        held = []
        for c in range(v):
            s = schedules.stage_of(r, c, pp)
            lo, hi = model_ranges[s]
            extra = (["wte, wpe"] if s == 0 else []) + (["ln_f, head (wte's copy), loss"] if s == pp * v - 1 else [])
            held.append(f"layers {lo}-{hi - 1}" if hi - lo > 1 else f"layer {lo}")
            held[-1] += (" + " + " + ".join(extra) if extra else "") + (f" (chunk {c})" if v > 1 else "")
        rows.append([f"rank {r}", "; ".join(held)])
    harness.table(rows, header=["stage", "holds"])


def measured_timeline(pp_runner, comm):
    """Every rank's actions of the last step: (op, mb, chunk, t0, t1) rows gathered on all ranks."""
    ev = np.array([(OPS.index(o), mb, c, t0, t1) for o, mb, c, t0, t1 in pp_runner.events], dtype=np.float64)
    out = np.empty((comm.Get_size(),) + ev.shape, dtype=np.float64)
    comm.Allgather(ev, out)              # the report's own message, outside the counters (as mpi_reduce)
    return out


# ------------------------------------------------------------------------------------- 1. the setup

def setup(args):
    """The input checked, the grid and the schedule built, the run described: the lesson's
    state, which the sections below read and add to."""
    comm = harness.comm_world()
    world = comm.Get_size()
    cfg = common.config_from_args(args, world)
    pp, v, _ = check_input(args, cfg, world)
    m = args.micro_batches
    data = common.load_dataset(args, comm)
    grid = ProcessGrid(pp=pp, comm=comm)
    sched = schedules.build(args.schedule, pp, m, v)
    say(textwrap.fill(f"Lesson 04: pipeline parallelism, pp={pp}" + (f" x dp={grid.dp}" if grid.dp > 1 else "")
                      + f" on {world} ranks, schedule {args.schedule}" + (f" with {v} chunks per rank" if v > 1 else "")
                      + f", m={m} micro-batches", WIDTH) + "\n")
    per_dp = args.batch_size // grid.dp
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"dropout={cfg.dropout} {cfg.dtype}")
    say(f"batch   global {args.batch_size} sequences" + (f" = {grid.dp} replicas x {per_dp}" if grid.dp > 1 else "")
        + f", {m} micro-batches of b={per_dp // m}")
    say(f"steps   {args.steps} AdamW steps, clipping at global norm {args.grad_clip}\n")
    stage_table(split_layers(cfg.n_layer, pp * v, args.extra_layers), pp, v, cfg.n_layer)
    return SimpleNamespace(args=args, comm=comm, world=world, cfg=cfg, pp=pp, v=v, m=m, data=data, grid=grid,
                           sched=sched, per_dp=per_dp)


# -------------------------------------------------------------------------- 2. the schedule as data

def schedule_section(run):
    """The picture and the simulator (with --latency, also the simulation with messages that
    take time, and with --chunks the warm-up's factor 2)."""
    args, pp, m, v = run.args, run.pp, run.m, run.v
    run.sim = schedules.simulate(run.sched, pp, m, v)
    run.bubble_formula = bubble_fraction(args.schedule, pp, m, v)
    lam = None if args.latency is None else Fraction(args.latency).limit_denominator(1000)   # in cells
    run.late = None if lam is None else schedules.simulate(run.sched, pp, m, v, latency=lam / v)
    say("\nthe schedule, time in units of one chunk's forward (F = 1, B = 2"
        + (",\nsplit into B = 1 and W = 1" if args.schedule == "zb-h1" else "") + "; '.' is the bubble)"
        + ("" if lam is None else f",\nmessages taking {args.latency:g} of a cell (--latency; each action drawn "
           "from the cell nearest its start)"))
    say(schedules.picture(run.sched, v, latency=0 if lam is None else lam / v, width=WIDTH))
    if lam is not None:
        say(f"  one step: {_cells(run.sim.total * v)} cells with free messages, {_cells(run.late.total * v)} with "
            f"messages of {args.latency:g}: bubble {float(run.sim.bubble):.4f} -> {float(run.late.bubble):.4f}")
    run.factor_figures = warmup_factor_report(pp, m, v, lam, args.latency) if lam is not None and v > 1 else {}


# ----------------------------------------------------------------------- 3. the run and one process

def pipeline_run(run):
    """Train the pipeline (with --pp below the world size, data-parallel replicas of it)."""
    args, cfg, grid = run.args, run.cfg, run.grid
    run.tc = tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                              min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    run.model = model = PipelineGPT(GPT(cfg, seed=args.seed), run.pp, grid.pp_rank, run.v, args.extra_layers)
    dp = NaiveDataParallel(model, grid.dp_comm) if grid.dp > 1 else None
    run.runner = PipelineParallel(model, grid.pp_comm, args.schedule, run.m, dp)
    run.opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    run.rows = slice(grid.dp_rank * run.per_dp, (grid.dp_rank + 1) * run.per_dp)
    MEMORY.reset_peak()
    with stats.measure() as run.meas:
        losses, run.state, run.times = common.train_and_collect(model, run.opt, run.data, args, tc, run.rows,
                                                                run.m, run.runner)
    run.act_peak = MEMORY.peak_bytes
    # this run's host<->device bytes per step (0 on the CPU), before zb-h1's 1F1B rerun records its own
    run.moved = equivalence.host_device_bytes_per_step()
    run.losses = list(common.mpi_reduce(grid.dp_comm, losses, "sum") / grid.dp)


def compare_section(run):
    """The reference: one process, the whole model and batch; each rank compares what it holds."""
    args, cfg, comm, grid, tc, state = run.args, run.cfg, run.comm, run.grid, run.tc, run.state
    ref = GPT(cfg, seed=args.seed)
    ref_opt = ref.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    run.ref_losses, ref_state, _ = common.train_and_collect(ref, ref_opt, run.data, args, tc)
    mine = {k: ref_state[k] for k in state}
    state["loss"], mine["loss"] = np.array(run.losses), np.array(run.ref_losses)
    rel, abs_diff, _ = harness.compare(state, mine)
    run.rel, run.abs_diff = common.mpi_reduce(comm, [rel, abs_diff])
    held = {n for n, _ in run.model.named_parameters()}
    everything = {n for n, _ in ref.named_parameters()}
    covered = set().union(*[set(x) for x in _allgather_names(grid.pp_comm, held)])
    run.tol = harness.TOLERANCE[cfg.dtype]
    run.match = bool(run.rel <= run.tol) and covered == everything
    common.report_comparison(comm, f"pp={run.pp}" + (f" x dp={grid.dp}" if grid.dp > 1 else ""), run.ref_losses,
                             run.losses, state, mine, run.tol,
                             notes=["each stage against the same names of the whole model; wte on the first "
                                    "and the last stage"])
    if covered != everything:
        say(f"  parameters no stage holds: {sorted(everything - covered)}")


# ------------------------------------------------------------------------------------ 4. the bubble

def bubble_section(run):
    """Each rank's idle fraction: simulated, by formula, measured (the last step's timeline);
    under zb-h1 also the idle times of ZB-H1 and 1F1B (zero_bubble_report)."""
    args, comm, grid, world, sim, late = run.args, run.comm, run.grid, run.world, run.sim, run.late
    run.tl = tl = measured_timeline(run.runner, comm)
    tl[:, :, 3:] -= tl[:, :, 3].min()       # perf_counter: one monotonic clock for the processes of a node
    span = tl[:, :, 4].max() - tl[:, :, 3].min()
    run.idle = idle = [1 - float((tl[r, :, 4] - tl[r, :, 3]).sum()) / span for r in range(world)]
    say("\nthe bubble: idle fraction of each rank's time in one step")
    sims = [sim] + ([] if late is None else [late])
    harness.table([[f"rank {r}" + ("" if grid.dp == 1 else f" (stage {grid.coords(r)[1]})")]
                   + [f"{float(1 - x.busy[grid.coords(r)[1]] / x.total):.3f}" for x in sims] + [f"{idle[r]:.3f}"]
                   for r in range(world)],
                  header=["", "simulated"] + ([] if late is None else [f"latency {args.latency:g}"]) + ["measured"])
    fname = bubble_text(args.schedule, run.v)
    run.sim_b, run.meas_b = sim_b, meas_b = float(sim.bubble), float(np.mean(idle))
    formula = run.bubble_formula
    exact = sim.bubble == formula
    say(f"  whole pipeline: simulated {sim_b:.4f} ({sim.bubble}), formula {fname} = {float(formula):.4f}"
        f" ({formula}),\n  measured {meas_b:.3f}"
        + ("; simulated = formula" if exact else "; the formula assumes m >= p" if run.m < run.pp else "")
        + ("" if late is None else f"; simulated with latency {args.latency:g}: {float(late.bubble):.4f}"))
    cores = os.cpu_count() or 1
    say("  measured: wall time, where a backward costs what it costs (not exactly 2 forwards) and messages\n"
        "  take time" + (f"; and here {comm.Get_size()} ranks share {cores} cores, so a rank waiting in MPI\n"
                         "  takes a core from one that computes: read the simulated column first"
                         if comm.Get_size() > cores else ""))
    run.zb_figures = zero_bubble_report(run.runner, grid, comm, run.cfg, args, run.tc, run.data, run.rows, run.m) \
        if args.schedule == "zb-h1" else {}


# --------------------------------------------------------------------- 5. activations alive at once

def activations_section(run):
    """The micro-batches whose activations were alive at once, measured beside the simulator."""
    args, comm, grid, world, pp, m, v = run.args, run.comm, run.grid, run.world, run.pp, run.m, run.v
    peaks = common.mpi_reduce(comm, [run.runner.peak_live if r == comm.Get_rank() else 0 for r in range(world)],
                              "max")
    run.peaks = peaks = [int(x) for x in np.atleast_1d(peaks)]
    run.want_peaks = want_peaks = [run.sim.peak[grid.coords(r)[1]] for r in range(world)]
    unit = "(micro-batch, chunk) pairs" if v > 1 else "micro-batches"
    say(f"\npeak live activations: {unit} whose forward ran and whose " + ("W" if args.schedule == "zb-h1" else "B")
        + " had not")
    formula = [live_chunks(args.schedule, pp, m, v, grid.coords(r)[1]) for r in range(world)]
    harness.table([[f"rank {r}", want_peaks[r], peaks[r], "-" if formula[r] is None else formula[r],
                    "equal" if peaks[r] == want_peaks[r] else "DIFFERENT"] for r in range(world)],
                  header=["", "simulated", "measured in the run", "formula", ""])
    expect = {"gpipe": f"GPipe keeps all m = {m}", "1f1b": f"1F1B keeps at most p - r (<= {pp})",
              "interleaved": "interleaved keeps 2(p-r-1) + (v-1)p + 1 chunks (at most m v)",
              "zb-h1": f"ZB-H1 keeps at most p = {pp}", "naive": "one at a time"}.get(args.schedule, "")
    if expect:
        saved = ("saved-for-backward bytes at the peak: "
                 f"{fmt_bytes(common.mpi_reduce(comm, run.act_peak))} (largest rank)")
        say(f"  {expect}; {saved}" if len(expect) + len(saved) < 96 else f"  {expect};\n  {saved}")
    if args.schedule == "1f1b" and m >= pp:
        say(f"  stage 0 holds p = {pp} micro-batches of L/p layers: L layers' worth, as much as one process\n"
            "  with one micro-batch. Pipelining does not cut stage 0's peak activations (Korthikanti et al.\n"
            "  2022, 4.2.3); sequence parallelism and recomputation do.")
    elif args.schedule == "interleaved" and m >= pp:
        c = want_peaks[0]
        full = warmup_forwards(pp, m, v, 0) < m * v            # the warm-up not capped at m v
        say(f"  stage 0 holds {c} chunks of L/(pv) layers: {c}/{pp * v} = {c / (pp * v):.4g} x L layers' worth"
            + (" = 1 + (p-1)/(pv);" if full else f",\n  capped at m v = {m * v} (uncapped: 1 + (p-1)/(pv));")
            + "\n  interleaving raises stage 0's peak by up to (p-1)/(pv) over 1F1B's\n"
            "  (Korthikanti et al. 2022, 4.2.3).")
    run.peaks_ok = peaks == want_peaks


# -------------------------------------------------------------------------- 6. point-to-point bytes

def p2p_section(run):
    """The bytes each rank sent point-to-point per step, measured beside the exact count and
    the whole pipeline's 2 (p v - 1) m b s h (plan.pipeline.step_p2p_bytes)."""
    args, cfg, comm, grid, world, m, v = run.args, run.cfg, run.comm, run.grid, run.world, run.m, run.v
    item = np.dtype(cfg.dtype).itemsize
    b = run.per_dp // m
    sizes = [b] * m
    run.got = got = [int(x) for x in np.atleast_1d(common.mpi_reduce(
        comm, [run.meas.bytes_sent("send") // args.steps if r == comm.Get_rank() else 0 for r in range(world)]))]
    run.want = want = [int(x) for x in np.atleast_1d(common.mpi_reduce(
        comm, [expected_p2p_bytes(run.model, sizes, item) if r == comm.Get_rank() else 0 for r in range(world)]))]
    bsh = p2p_bytes(b, cfg.block_size, cfg.n_embd, 1)
    say(f"\npoint-to-point bytes sent per step: b*s*h = {b}*{cfg.block_size}*{cfg.n_embd} = {bsh:,} values\n"
        f"per micro-batch per boundary, each way")
    harness.table([[f"rank {r}", f"{got[r]:,}", f"{want[r]:,}", "equal" if got[r] == want[r] else "DIFFERENT"]
                   for r in range(world)], header=["", "measured", "formula", ""])
    per_replica = step_p2p_bytes(run.pp, v, m, b, cfg.block_size, cfg.n_embd, item)
    say(f"  whole pipeline: 2 (p v - 1) m b s h x {item} bytes = {per_replica:,}"
        + (f" per replica x {grid.dp} = {per_replica * grid.dp:,}" if grid.dp > 1 else "") + f"; measured {sum(got):,}")
    say("  besides: one all-reduce of wte's gradient between the first and last stage, one of the\n"
        "  squared norm for clipping, the loss broadcast from the last stage")
    run.bytes_ok = got == want


# ------------------------------------------------------------------------------------ 7. the report

def report_section(run):
    """The step time, the figures and the verdict."""
    args, comm, world, grid, model, opt = run.args, run.comm, run.world, run.grid, run.model, run.opt
    step_time = common.mpi_reduce(comm, float(np.median(run.times)))
    say(f"\ntraining step: median {step_time * 1e3:.1f} ms (slowest rank)")
    figures = {"bubble_simulated": run.sim_b, "bubble_formula": float(run.bubble_formula),
               "bubble_measured": run.meas_b, "p2p_bytes_measured": sum(run.got), "p2p_bytes_formula": sum(run.want)}
    if run.late is not None:
        figures.update({"latency_chunk_forwards": args.latency, "bubble_simulated_latency": float(run.late.bubble)},
                       **run.factor_figures)
    figures.update(run.zb_figures)
    figures["host_device_bytes_per_step"] = run.moved
    for r in range(world):
        figures[f"peak_live_simulated_rank{r}"] = run.want_peaks[r]
        figures[f"peak_live_measured_rank{r}"] = run.peaks[r]
        figures[f"idle_measured_rank{r}"] = run.idle[r]
    mem = {"params": int(common.mpi_reduce(comm, sum(p.data.nbytes for p in model.parameters()))),
           "grads": int(common.mpi_reduce(comm, sum(p.grad.nbytes for p in model.parameters() if p.grad is not None))),
           "optimizer": int(common.mpi_reduce(comm, opt.state_bytes())),
           "activations_peak": int(common.mpi_reduce(comm, run.act_peak))}
    report = harness.new_report(
        "04_pipeline_parallel", args, parallel={"pp": run.pp, "dp": grid.dp, "tp": 1, "schedule": args.schedule,
                                                "micro_batches": run.m, "chunks": run.v},
        match=bool(run.match and run.peaks_ok and run.bytes_ok), max_rel_diff=run.rel, max_abs_diff=run.abs_diff,
        tolerance=run.tol, losses={"reference": run.ref_losses, "parallel": run.losses},
        comm={"bytes_sent": {"send": max(run.got)}, "expected_bytes": {"send": max(run.want)}},
        memory=mem, step_time_s=step_time, figures=figures)
    say("\nthe verdict needs: losses, raw gradients and weights within the tolerance; every parameter on\n"
        "some stage; peak live activations equal to the simulator's; point-to-point bytes equal to the\nformula")
    if not run.peaks_ok:
        say("\nthe run kept other numbers of activations alive than the schedule says")
    if not run.bytes_ok:
        say("\nthe bytes sent differ from b*s*h per micro-batch per boundary: a message too many, or of the wrong size")
    return report


def main(args):
    run = setup(args)
    schedule_section(run)
    pipeline_run(run)
    compare_section(run)
    bubble_section(run)
    activations_section(run)
    p2p_section(run)
    if args.trace:
        _write_trace(args.trace, run.tl, run.grid)
    return harness.finish(report_section(run), args)


def step_idle(runner, pp_comm):
    """Each step's idle seconds of this rank: the pipeline's span (first start to last end,
    over the ranks of this pipeline, one clock per node) less this rank's busy time."""
    out = []
    for events in runner.history:
        ev = np.array([(t0, t1) for *_, t0, t1 in events], dtype=np.float64)
        ends = np.empty(2 * pp_comm.Get_size(), dtype=np.float64)
        pp_comm.Allgather(np.array([ev[:, 0].min(), -ev[:, 1].max()]), ends)   # the report's own message
        span = -ends[1::2].min() - ends[0::2].min()
        out.append(span - float((ev[:, 1] - ev[:, 0]).sum()))
    return out


def zero_bubble_report(runner, grid, comm, cfg, args, tc, data, rows, m):
    """ZB-H1 measured: each rank's median F, B and W, then its idle time per step beside
    1F1B's (run again on a copy of the model, same steps and batches) and beside the
    simulator's, which runs both schedules with the measured times (averaged over ranks)."""
    world, pp, r = comm.Get_size(), grid.pp, comm.Get_rank()

    def per_rank(x):                                    # one number from every rank, on all
        return [float(y) for y in np.atleast_1d(common.mpi_reduce(
            comm, [x if k == r else 0.0 for k in range(world)], "max"))]

    model = PipelineGPT(GPT(cfg, seed=args.seed), pp, grid.pp_rank, 1, args.extra_layers)
    dp = NaiveDataParallel(model, grid.dp_comm) if grid.dp > 1 else None
    ofob = PipelineParallel(model, grid.pp_comm, "1f1b", m, dp)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    common.train_and_collect(model, opt, data, args, tc, rows, m, ofob)
    ms = {op: per_rank(1e3 * float(np.median(runner.durations[op]))) for op in "FBW"}
    ms1 = {op: per_rank(1e3 * float(np.median(ofob.durations[op]))) for op in "FB"}
    idle = per_rank(1e3 * float(np.median(step_idle(runner, grid.pp_comm))))
    idle1 = per_rank(1e3 * float(np.median(step_idle(ofob, grid.pp_comm))))
    F, B, W = (float(np.mean(ms[op])) for op in "FBW")
    costs = tuple(Fraction(x).limit_denominator(10 ** 6) for x in (F, B + W, W))
    sims = {name: schedules.simulate(schedules.build(name, pp, m), pp, m, costs=costs) for name in ("zb-h1", "1f1b")}
    sim_idle = {name: [float(x.total - x.busy[grid.coords(k)[1]]) for k in range(world)] for name, x in sims.items()}
    n = len(runner.history)
    say(f"\nzero bubble, measured: ms per action, medians over {m} micro-batches x {n} steps. ZB-H1's B\n"
        "computes the input gradients only, its W the linears' weight gradients; 1F1B ran the same\n"
        "steps on a copy of the model, its B the whole backward")
    label = [f"rank {k}" + ("" if grid.dp == 1 else f" (stage {grid.coords(k)[1]})") for k in range(world)]
    harness.table([[label[k], f"{ms['F'][k]:.2f}", f"{ms['B'][k]:.2f}", f"{ms['W'][k]:.2f}",
                    f"{ms['B'][k] + ms['W'][k]:.2f}", f"{ms1['F'][k]:.2f}", f"{ms1['B'][k]:.2f}"]
                   for k in range(world)],
                  header=["", "F", "B", "W", "B + W", "1F1B F", "1F1B B"])
    say(f"idle ms per rank and step: the simulator first, fed the measured F = {F:.2f}, B = {B:.2f},\n"
        f"W = {W:.2f} (means over ranks), then the run (median over the {n} steps)")
    harness.table([[label[k], f"{sim_idle['zb-h1'][k]:.2f}", f"{idle[k]:.2f}", f"{sim_idle['1f1b'][k]:.2f}",
                    f"{idle1[k]:.2f}"] for k in range(world)],
                  header=["", "ZB-H1 simulated", "ZB-H1 measured", "1F1B simulated", "1F1B measured"])
    zb, ob = idle_time("zb-h1", pp, F, B, W), idle_time("1f1b", pp, F, B, W)
    say(f"  formula (Qi et al.): ZB-H1 (p-1)(F+B-W) = {pp - 1} x ({F:.2f} + {B:.2f} - {W:.2f}) = {zb:.2f} ms;\n"
        f"  1F1B (p-1)(F+B+W) = {ob:.2f} ms. Measured ZB-H1 {float(np.median(idle)):.2f}, "
        f"1F1B {float(np.median(idle1)):.2f} (medians over ranks)")
    say(f"  measured idle is noisy here, and larger: {world} ranks share {_cores()} cores, so a rank waiting\n"
        "  in MPI spins on a core another rank needs, and the time between actions (the exchange,\n"
        "  Python) counts as idle. The simulator leaves both out; the formula also assumes m >= p\n"
        "  and equal stages")
    out = {"zb_idle_formula_ms": zb, "oneFoneB_idle_formula_ms": ob}
    for k in range(world):
        out.update({f"zb_F_ms_rank{k}": ms["F"][k], f"zb_B_ms_rank{k}": ms["B"][k], f"zb_W_ms_rank{k}": ms["W"][k],
                    f"zb_idle_simulated_ms_rank{k}": sim_idle["zb-h1"][k], f"zb_idle_measured_ms_rank{k}": idle[k],
                    f"oneFoneB_idle_simulated_ms_rank{k}": sim_idle["1f1b"][k],
                    f"oneFoneB_idle_measured_ms_rank{k}": idle1[k]})
    return out


def _cores():
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _cells(t):
    """A time in cells as the pictures count them: 57, 60.5."""
    return f"{float(t):g}"


def warmup_factor_report(p, m, v, lam, shown):
    """What the factor 2 in the interleaved warm-up buys: the schedule with it and without it,
    simulated with messages that take no time and with messages of lam cells (one chunk's
    forward each). Prints a table and the picture without the factor; returns the figures."""
    runs = {}
    for k in (2, 1):
        sch = schedules.interleaved_1f1b(p, m, v, warmup_factor=k)
        runs[k] = (sch, schedules.simulate(sch, p, m, v), schedules.simulate(sch, p, m, v, latency=lam / v))
    warm = {k: [warmup_forwards(p, m, v, r, k) for r in range(p)] for k in (2, 1)}
    say(f"\nthe interleaved warm-up: rank r runs 2(p-r-1) + (v-1)p forwards (at most m v) before it\n"
        f"alternates; without the factor 2, (p-r-1) + (v-1)p. Messages free, and taking {shown:g} of a cell:")
    ranks = f"rank 0..{p - 1}" if p > 1 else "rank 0"
    rows = [[f"warm-up forwards, {ranks}"] + [" ".join(map(str, warm[k])) for k in (2, 1)],
            [f"peak live, {ranks}"] + [" ".join(map(str, runs[k][1].peak)) for k in (2, 1)],
            ["bubble, messages free"] + [f"{float(runs[k][1].bubble):.4f}" for k in (2, 1)],
            [f"bubble, messages {shown:g}"] + [f"{float(runs[k][2].bubble):.4f}" for k in (2, 1)],
            ["one step, in cells"] + [f"{_cells(runs[k][1].total * v)} -> {_cells(runs[k][2].total * v)}"
                                      for k in (2, 1)]]
    harness.table(rows, header=["", "2(p-r-1) + (v-1)p", "(p-r-1) + (v-1)p"])
    longer = {k: (runs[k][2].total - runs[k][1].total) * v for k in (2, 1)}
    fill = latency_fill_drain(p, v, lam)
    say(f"  messages of {shown:g} make the step {_cells(longer[2])} cells longer with the factor"
        + (f", 2(pv-1) x {shown:g}: only the fill\n  and the drain wait for them;" if longer[2] == fill else ",")
        + f" {_cells(longer[1])} cells longer without it")
    say(f"\nthe same schedule without the factor 2, messages taking {shown:g} of a cell:")
    say(schedules.picture(runs[1][0], v, latency=lam / v, width=WIDTH))
    say("  Without the factor the schedule is as valid, as fast while messages are free, and holds p-r-1\n"
        "  fewer micro-batches on rank r. But its steady state has almost no slack: most forwards wait\n"
        "  for inputs that free messages bring just in time, so a message that takes time is waited\n"
        "  for again, step after step (the dots amid the steady state above). The factor keeps p-r-1\n"
        "  more micro-batches in flight: a latency of up to one cell is then paid on the fill and the\n"
        "  drain only.")
    return {"bubble_simulated_latency_warmup_factor_1": float(runs[1][2].bubble),
            "bubble_simulated_warmup_factor_1": float(runs[1][1].bubble)}


def _allgather_names(comm, names):
    """The parameter names every stage holds, exchanged as one fixed-size uint8 buffer each."""
    blob = np.frombuffer("\n".join(sorted(names)).encode(), dtype=np.uint8)
    n = np.array([blob.size], dtype=np.int64)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(n, sizes)
    buf = np.zeros(int(sizes.max()), dtype=np.uint8)
    buf[:blob.size] = blob
    out = np.empty((comm.Get_size(), buf.size), dtype=np.uint8)
    comm.Allgather(buf, out)
    return [bytes(out[i, :sizes[i]]).decode().split("\n") for i in range(comm.Get_size())]


def _write_trace(path, tl, grid):
    from minidist.trace import chrome_trace
    if grid.rank != 0:
        return
    tracks = {r: [(f"{OPS[int(o)]}{int(mb)}" + (f".{int(c)}" if tl[:, :, 2].max() > 0 else ""), t0, t1, OPS[int(o)])
                  for o, mb, c, t0, t1 in tl[r]] for r in range(len(tl))}
    chrome_trace(tracks, path, process="lesson 04: one step of the pipeline")
    say(f"trace of the last step written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)")


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=8, n_head=2, n_embd=32, block_size=16, batch_size=8)
    p.add_argument("--schedule", choices=schedules.NAMES, default="1f1b")
    p.add_argument("--micro-batches", type=harness.positive_int, metavar="M",
                   help="micro-batches per step and replica (default: 8, at most one sequence each)")
    p.add_argument("--chunks", type=harness.positive_int, metavar="V",
                   help="model chunks per rank for --schedule interleaved only (default 2)")
    p.add_argument("--pp", type=harness.positive_int, help="pipeline stages (default: the world size)")
    p.add_argument("--extra-layers", choices=EXTRA_LAYERS, default="first",
                   help="when the layers do not divide evenly, which stages take one more: the first ones "
                        "(default) or the last ones, sparing stage 0 (it holds the embedding and, under 1F1B, "
                        "p micro-batches' activations)")
    p.add_argument("--latency", type=latency_value, metavar="F",
                   help="give each message between ranks the time of F chunk forwards (0.25: a quarter of one; "
                        f"more than 0, at most {MAX_LATENCY}) in the picture and the simulated bubble; with "
                        "--schedule interleaved, also the same schedule without the factor 2 of its warm-up")
    harness.add_output(p, "--trace", help="write the last step's timeline as Chrome trace JSON")
    common.add_step_flags(p, clip_off=False)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
