"""Lesson 07: 3D parallelism. Tensor parallelism inside each pipeline stage, the pipeline
across stages, data parallelism (or ZeRO-1) across replicas, on one grid of ranks; the
run must equal one process.

    mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 2 --pp 2 --dp 2
    mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 2 --pp 4
    mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 4 --pp 2 --schedule gpipe
    mpirun -n 8 python -m minidist.lessons.07_3d_parallel --pp 2 --dp 4 --zero 1 --dropout 0.1
    mpirun -n 4 python -m minidist.lessons.07_3d_parallel --tp 2 --json out.json
    mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 2 --pp 2 --dp 2 --recompute full
    mpirun -n 12 python -m minidist.lessons.07_3d_parallel --tp 3 --pp 2 --dp 2 --n-head 6 --n-embd 48
    MINIDIST_DEVICE=strict mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 2 --pp 2

The grid is tp fastest, then pp, then dp (minidist/comm/grid.py): on a cluster the TP
group is one node's GPUs. The lesson prints every rank's role, compares the losses, the
raw gradients of every step (each rank's shard, or its ZeRO partition of it) and the
weights with one process, then the bytes each rank sent per step by group beside the
formulas of lessons 02-05, memory per rank by category beside the ZeRO paper's count of
the rank's parameters, and the pipeline's bubble. --recompute runs each stage's TP blocks
under a recomputation policy (lesson 08): the numbers must not change, the TP group sends
each checkpointed layer's two forward all-reduces again.
"""
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from minidist.comm import ProcessGrid
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel import schedules
from minidist import recompute
from minidist.parallel.parallel_3d import (GROUPS, Parallel3D, build_stage, expected_memory, expected_traffic,
                                           reference_value, stage_param_count)
from minidist.parallel.pipeline_parallel import split_layers
from minidist.parallel.tensor_parallel import vocab_range
from minidist.parallel.zero import ZeRO
from minidist.plan.pipeline import bubble_fraction
from minidist.plan.traffic import dp_bytes
from minidist.tensor import MEMORY
from minidist.train import TrainConfig


def check_input(args, cfg, world):
    """Every rank finds the same answer: bad input ends the job with one message, exit 2."""
    tp, pp = args.tp, args.pp
    harness.need(world % (tp * pp) == 0 if args.dp is None else tp * pp * args.dp == world,
                 f"--tp {tp} x --pp {pp}" + (f" x --dp {args.dp} = {tp * pp * args.dp}" if args.dp else
                                             f" = {tp * pp} does not divide the {world} ranks") +
                 ("" if args.dp is None else f" ranks, but the world has {world}") +
                 f": choose sizes whose product is {world}")
    dp = args.dp or world // (tp * pp)
    harness.need(cfg.n_head % tp == 0, f"--tp {tp} must divide the {cfg.n_head} heads (--n-head): each "
                                       f"tensor-parallel rank takes whole heads; this works: "
                                       f"{harness.command_with(world, harness.heads_fix(cfg.n_head, cfg.n_embd, tp))}")
    harness.need(args.chunks is None or args.schedule == "interleaved",
                 f"--chunks {args.chunks} applies to --schedule interleaved only (--schedule {args.schedule} "
                 f"gives each rank one chunk)")
    v = (args.chunks or 2) if args.schedule == "interleaved" else 1
    harness.need(pp * v <= cfg.n_layer, f"{pp * v} pipeline stages but only {cfg.n_layer} layers: every stage "
                                        f"needs a layer (--n-layer {pp * v} or more, or a smaller --pp)")
    if args.micro_batches is None:
        args.micro_batches = max(1, min(4, args.batch_size // dp))
    m = args.micro_batches
    if args.schedule == "interleaved":
        harness.need(m % pp == 0 and cfg.n_layer % (pp * v) == 0,
                     f"interleaved 1F1B needs --micro-batches a multiple of {pp} and --n-layer a multiple of {pp * v}")
    harness.need(args.batch_size % (dp * m) == 0,
                 f"--batch-size {args.batch_size} must split into {dp} replica(s) x {m} micro-batches of equal size; "
                 f"this works: {harness.command_with(world, {'--batch-size': -(-args.batch_size // (dp * m)) * dp * m})}")
    return tp, pp, dp, v, m


def role_table(grid, cfg, v, slot):
    """rank -> coordinates, the layers of its stage, its shards (and its ZeRO partition)."""
    ranges = split_layers(cfg.n_layer, grid.pp * v)
    part = np.array([slot.zero.groups[0].lo, slot.zero.groups[0].hi, slot.zero.groups[0].n]
                    if slot.zero is not None else [0, 0, 0], dtype=np.int64)
    parts = np.empty((grid.size, 3), dtype=np.int64)
    grid.world.Allgather(part, parts)          # the report's own message, outside the counters
    nh, hid = cfg.n_head // grid.tp, 4 * cfg.n_embd // grid.tp
    rows = []
    for r in range(grid.size):
        d, p, t = grid.coords(r)
        stages = [schedules.stage_of(p, c, grid.pp) for c in range(v)]
        layers = ", ".join(f"{ranges[s][0]}-{ranges[s][1] - 1}" if ranges[s][1] - ranges[s][0] > 1
                           else f"{ranges[s][0]}" for s in stages)
        ends = (["wte, wpe"] if 0 in stages else []) + (["ln_f, head"] if grid.pp * v - 1 in stages else [])
        lo, hi = vocab_range(cfg.vocab_size, grid.tp, t)
        shards = f"heads {t * nh}-{(t + 1) * nh - 1}, MLP cols {t * hid}-{(t + 1) * hid - 1}"
        if ends:
            shards += f", vocab {lo}-{hi - 1}"
        rows.append([r, d, p, t, layers + (" + " + ", ".join(ends) if ends else ""), shards]
                    + ([f"{parts[r, 0]}:{parts[r, 1]} of {parts[r, 2]}"] if slot.zero is not None else []))
    harness.table(rows, header=["rank", "dp", "pp", "tp", "layers", "shards"]
                  + (["ZeRO-1 partition"] if slot.zero is not None else []))


# ------------------------------------------------------------------------------------- 1. the setup

def setup(args):
    """The input checked, the grid built, the run described: the lesson's state, which the
    sections below read and add to."""
    comm = harness.comm_world()
    world = comm.Get_size()
    cfg = common.config_from_args(args, world)
    tp, pp, dp, v, m = check_input(args, cfg, world)
    data = common.load_dataset(args, comm)
    grid = ProcessGrid(tp=tp, pp=pp, dp=dp, comm=comm)
    per_dp = args.batch_size // dp
    say(f"Lesson 07: 3D parallelism, tp={tp} x pp={pp} x dp={dp} on {world} ranks,\nschedule {args.schedule}"
        f" with m={m} micro-batches" + (", ZeRO-1 over dp" if args.zero else ", plain averaging over dp") + "\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"dropout={cfg.dropout} {cfg.dtype}")
    say(f"batch   global {args.batch_size} = {dp} replica(s) x {m} micro-batches of b={per_dp // m}")
    say(f"steps   {args.steps} AdamW steps, clipping at global norm {args.grad_clip}")
    say(f"recompute {args.recompute}" + (f" (a checkpoint per k={args.k or 'round(sqrt(L_r))'} of each stage's blocks)"
                                         if args.recompute == "every-k" else "") + "\n")
    return SimpleNamespace(args=args, comm=comm, world=world, cfg=cfg, tp=tp, pp=pp, dp=dp, v=v, m=m, data=data,
                           grid=grid, per_dp=per_dp)


# -------------------------------------------------------------------------------- 2. who holds what

def roles_section(run):
    """Each rank's stage, TP shards and (with --zero 1) ZeRO partition, built and shown."""
    args, cfg, grid = run.args, run.cfg, run.grid
    run.tc = tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                              min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    run.stage, run.tp_model = build_stage(GPT(cfg, seed=args.seed), grid, run.v, args.recompute, args.k)
    stage = run.stage
    opt = stage.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    run.zero = ZeRO(stage, opt, grid.dp_comm, 1) if args.zero else None
    run.slot = Parallel3D(stage, run.tp_model, grid, args.schedule, run.m, opt, run.zero)
    say("who holds what (tp varies fastest: a TP group is neighbouring ranks, one node's GPUs)")
    say("  the order is tp, then pp, then dp (ProcessGrid), so each replica is one block of neighbouring\n"
        "  ranks; Megatron-LM's default differs (tp, then dp, pipeline outermost) to keep DP groups\n"
        "  near each other")
    role_table(grid, cfg, run.v, run.slot)


# ----------------------------------------------------------------------- 3. the run and one process

def parallel_run(run):
    """Train the 3D layout: each replica's rows, m micro-batches through the pipeline."""
    grid, per_dp = run.grid, run.per_dp
    run.rows = slice(grid.dp_rank * per_dp, (grid.dp_rank + 1) * per_dp)
    MEMORY.reset_peak()
    losses, run.state, run.times = common.train_and_collect(run.stage, run.slot, run.data, run.args, run.tc,
                                                            run.rows, run.m, run.slot)
    run.act_peak = MEMORY.peak_bytes
    run.losses = list(common.mpi_reduce(grid.dp_comm, losses, "sum") / run.dp)


def compare_section(run):
    """The reference: one process; each rank compares what it holds, cut as it holds it."""
    args, cfg, comm, tc, state = run.args, run.cfg, run.comm, run.tc, run.state
    ref = GPT(cfg, seed=args.seed)
    ref_opt = ref.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    run.ref_losses, ref_state, _ = common.train_and_collect(ref, ref_opt, run.data, args, tc)
    mine = {k: reference_value(k, ref_state, run.tp_model) for k in state}
    state["loss"], mine["loss"] = np.array(run.losses), np.array(run.ref_losses)
    rel, abs_diff, _ = harness.compare(state, mine)
    run.rel, run.abs_diff = common.mpi_reduce(comm, [rel, abs_diff])
    names = sorted(n for n, _ in ref.named_parameters())
    held = {n for n, _ in run.stage.named_parameters()}
    run.covered = bool(np.all(common.mpi_reduce(comm, [float(n in held) for n in names])))
    run.tol = harness.TOLERANCE[cfg.dtype]

    common.report_comparison(comm, f"tp={run.tp} x pp={run.pp} x dp={run.dp}", run.ref_losses, run.losses, state,
                             mine, run.tol, notes=["each rank against the reference cut to its own shard"
                                                   + (", then to its ZeRO partition" if run.zero else "")])
    say(f"  every parameter of the model is held by some rank: {'yes' if run.covered else 'NO'}")


# -------------------------------------------------------------------------------- 4. bytes by group

def bytes_section(run):
    """Bytes per rank per step, by group: measured (last step) beside the formulas."""
    args, cfg, comm, grid, slot, world = run.args, run.cfg, run.comm, run.grid, run.slot, run.world
    tp, pp, dp, m = run.tp, run.pp, run.dp, run.m
    want = expected_traffic(slot, run.per_dp, cfg.block_size, clip=bool(args.grad_clip))
    flat = lambda d: [d[g].get(c, 0) for g in GROUPS for c in ("all_reduce", "send", "broadcast",   # noqa: E731
                                                              "reduce_scatter", "all_gather")]
    got_all = common.mpi_reduce(comm, [x if r == grid.rank else 0 for r in range(world) for x in flat(slot.traffic)])
    want_all = common.mpi_reduce(comm, [x if r == grid.rank else 0 for r in range(world) for x in flat(want)])
    got_all, want_all = np.reshape(got_all, (world, len(GROUPS), 5)), np.reshape(want_all, (world, len(GROUPS), 5))
    run.got_all, run.want_all = got_all, want_all
    say("\nbytes each rank sent in one step, by group: measured / formula (plan.traffic.parallel_3d_sent:\n"
        "TP's count of the stage's layers; b*s*h per micro-batch per boundary and the ring's count of wte's\n"
        "sum; the per-parameter all-reduce (lesson 02) or ZeRO's reduce-scatter + all-gather (lesson 05))")
    cell = lambda a, b: "-" if a == b == 0 else f"{int(a):,}" + (" =" if a == b else f" != {int(b):,}")   # noqa: E731
    harness.table([[r] + [cell(got_all[r, i].sum(), want_all[r, i].sum()) for i in range(len(GROUPS))]
                   for r in range(world)],
                  header=["rank", "tp all-reduces", "pp sends + wte + loss",
                          "dp " + ("rs + ag" if run.zero else "all-reduce"), "clip norm"])
    run.bytes_ok = bool(np.array_equal(got_all, want_all))
    bsh = run.per_dp // m * cfg.block_size * cfg.n_embd
    per_layer = 6 if args.recompute in ("full", "every-k") else 4       # the rerun repeats the 2 forward g's
    if tp > 1:
        say(f"  TP sends ({per_layer} L_r + ends) m all-reduces of b*s*h = {bsh:,} values"
            + (f" ({args.recompute} recomputation reruns each layer's 2 forward all-reduces)" if per_layer == 6 else "")
            + ":\n  the most, and every layer waits on them;")
    others = (["PP sends b*s*h per micro-batch per boundary"] if pp > 1 else []) + (
        [f"DP sends 2(d-1)/d = {dp_bytes(1, dp, 1):.3g}x this rank's gradient once per step"] if dp > 1 else [])
    if others:
        say("  " + ";\n  ".join(others))


# ------------------------------------------------------------------------------- 5. memory per rank

def memory_section(run):
    """Memory per rank by category, measured from the arrays after the last step, beside the
    formula."""
    cfg, comm, grid, slot, stage, zero, world = run.cfg, run.comm, run.grid, run.slot, run.stage, run.zero, run.world
    mem_rows = [sum(p.data.nbytes for p in stage.parameters()),
                zero.held_grad_bytes if zero else sum(p.grad.nbytes for p in stage.parameters() if p.grad is not None),
                slot.state_bytes(), run.act_peak]
    formula = expected_memory(slot)
    mem_rows += [formula["params"], formula["grads"], formula["optimizer"], stage_param_count(stage, run.tp_model)]
    run.mem = mem = np.reshape(common.mpi_reduce(comm, [x if r == grid.rank else 0 for r in range(world)
                                                        for x in mem_rows]), (world, 8))
    item = np.dtype(cfg.dtype).itemsize
    # the slack ZeRO-1's uneven cut allows: my partition is array_split's, Psi_r/N_d the paper's
    # even share, less than one element apart (in grads once, in AdamW's m and v twice)
    slack = np.array([0, item, 2 * item] if zero else [0, 0, 0])

    def beside(got, want, i):
        """measured and its mark: '=' equal, '~' within the slack, otherwise the formula."""
        mark = "=" if got == want else "~" if abs(got - want) < slack[i] else "!= " + fmt_bytes(want)
        return f"{fmt_bytes(int(got))} {mark}"
    say("\nmemory per rank (bytes held after the step) beside the formula (engine_state_bytes of Psi_r, the\n"
        "rank's parameters: its stage's layers' TP shards plus the replicated ones, from the shapes,\n"
        f"{item} bytes each):\nparams Psi_r, grads Psi_r" + (" + Psi_r/dp (ZeRO-1 keeps the local gradient and its partition)"
                                                     if zero else "") +
        (",\n" if zero else ", ") + "AdamW's m and v 2 Psi_r" + ("/dp" if zero else "") + "; activations: the peak saved for backward")
    harness.table([[r, f"{int(mem[r, 7]):,}"] + [beside(mem[r, i], mem[r, 4 + i], i) for i in range(3)]
                   + [fmt_bytes(int(mem[r, 3]))] for r in range(world)],
                  header=["rank", "Psi_r", "params", "grads", "optimizer", "activations peak"])
    run.memory_ok = bool(np.all((mem[:, :3] == mem[:, 4:7]) | (np.abs(mem[:, :3] - mem[:, 4:7]) < slack)))
    say("  '=' equal to the formula; '~' under ZeRO-1, within the one element array_split's partitions\n"
        "  differ from Psi_r/dp" if zero else "  '=' equal to the formula")


# ------------------------------------------------------------------------------------ 6. the bubble

def bubble_section(run):
    """The bubble of the schedule across the pp stages: simulated beside the formula."""
    args, pp, m, v = run.args, run.pp, run.m, run.v
    run.sim = schedules.simulate(schedules.build(args.schedule, pp, m, v), pp, m, v)
    run.bubble_formula = bubble_fraction(args.schedule, pp, m, v)
    say(f"\nthe bubble: simulated {float(run.sim.bubble):.4f}, formula {float(run.bubble_formula):.4f} "
        f"({args.schedule}, p={pp}, m={m}" + (f", v={v}" if v > 1 else "") + ")")


# ------------------------------------------------------------------------------------ 7. the report

def report_section(run):
    """The step time, the figures and the verdict."""
    args, got_all, want_all, mem = run.args, run.got_all, run.want_all, run.mem
    step_time = common.mpi_reduce(run.comm, float(np.median(run.times)))
    say(f"training step: median {step_time * 1e3:.1f} ms (slowest rank)")
    match = bool(run.rel <= run.tol) and run.covered and run.bytes_ok and run.memory_ok
    figures = {"bubble_simulated": float(run.sim.bubble), "bubble_formula": float(run.bubble_formula)}
    for i, g in enumerate(GROUPS):
        figures[f"bytes_{g}_measured_max"] = int(got_all[:, i].sum(axis=1).max())
        figures[f"bytes_{g}_formula_max"] = int(want_all[:, i].sum(axis=1).max())
    report = harness.new_report(
        "07_3d_parallel", args, parallel={"tp": run.tp, "pp": run.pp, "dp": run.dp, "zero": args.zero,
                                          "schedule": args.schedule, "micro_batches": run.m, "chunks": run.v,
                                          "recompute": args.recompute,
                                          "k": run.stage.recompute.k if args.recompute == "every-k" else None},
        match=match, max_rel_diff=run.rel, max_abs_diff=run.abs_diff, tolerance=run.tol,
        losses={"reference": run.ref_losses, "parallel": run.losses},
        comm={"bytes_sent": {g: figures[f"bytes_{g}_measured_max"] for g in GROUPS},
              "expected_bytes": {g: figures[f"bytes_{g}_formula_max"] for g in GROUPS}},
        memory=dict(zip(("params", "grads", "optimizer", "activations_peak", "params_formula", "grads_formula",
                         "optimizer_formula"), (int(x) for x in mem[:, :7].max(axis=0)))),
        step_time_s=step_time, figures=figures)
    say("\nthe verdict needs: losses, raw gradients and weights within the tolerance; every parameter on\n"
        "some rank; the bytes of every group equal to the formula; params, grads and optimizer state equal\n"
        "to the formula")
    return report


def main(args):
    run = setup(args)
    roles_section(run)
    parallel_run(run)
    compare_section(run)
    bytes_section(run)
    memory_section(run)
    bubble_section(run)
    return harness.finish(report_section(run), args)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=4, n_head=4, n_embd=32, block_size=16, batch_size=8)
    p.add_argument("--tp", type=harness.positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=harness.positive_int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--dp", type=harness.positive_int, help="data-parallel replicas (default: the rest of the world)")
    p.add_argument("--zero", type=int, choices=[0, 1], default=0, help="1: ZeRO stage 1 over the dp group")
    p.add_argument("--schedule", choices=schedules.NAMES, default="1f1b")
    p.add_argument("--micro-batches", type=harness.positive_int, metavar="M",
                   help="micro-batches per step and replica (default: up to 4)")
    p.add_argument("--chunks", type=harness.positive_int, metavar="V",
                   help="model chunks per rank for --schedule interleaved only (default 2)")
    p.add_argument("--recompute", choices=recompute.POLICIES, default="none",
                   help="activation recomputation of each stage's blocks (lesson 08; default none)")
    p.add_argument("--k", type=harness.positive_int, help="blocks per checkpoint for --recompute every-k "
                                                           "(default round(sqrt(L_r)), L_r the stage's layers)")
    common.add_step_flags(p, clip_off=False)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
