"""Lesson 08: activation recomputation. Keep less for backward, compute it again when needed;
the gradients must not change by a single bit.

    python -m minidist.lessons.08_activation_recompute
    python -m minidist.lessons.08_activation_recompute --policy every-k --k 2 --n-layer 9
    mpirun -n 2 python -m minidist.lessons.08_activation_recompute --tp 2
    mpirun -n 2 python -m minidist.lessons.08_activation_recompute --pp 2
    mpirun -n 4 python -m minidist.lessons.08_activation_recompute --tp 2 --pp 2
    python -m minidist.lessons.08_activation_recompute --json out.json

The same GPT (dropout on) trains a few AdamW steps under each policy of
minidist/recompute.py: none, full (every block a checkpoint), every-k (a checkpoint per k
blocks, k = sqrt(L)) and selective (the attention core only). For each it prints the
peak of the activation meter (minidist/context.py) over the blocks' forward and
backward beside this engine's count for the policy (plan.memory.recompute_peak_elements),
the whole step's peak, Korthikanti et al.'s per-layer figure, the step time and its
ratio to none, and how far the losses, raw gradients and weights are from none's (they
must be equal: 1e-12). Then a sweep over n_layer shows the blocks' memory growing as L
without recomputation and as sqrt(L) with a checkpoint every sqrt(L) blocks, and a scan over
k at this L finds the k that keeps the least, beside sqrt(L x / A). With
--tp the model is the tensor-parallel GPT of lesson 03: the rerun repeats the forward's
collectives, and the bytes sent are held to expected_bytes(recomputed_layers=...).
With --pp the model is lesson 07's 3D stage (tp x pp, dp 1; parallel_3d): each rank
applies the policy to its stage's L_r blocks, the pipeline's 1F1B backward starts each
stage's checkpoints from the gradient the next stage sends, and every rank's peak over
its blocks (one micro-batch) is printed beside the count for its L_r blocks.
"""
import argparse
import math
import time
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from minidist import recompute
from minidist.backend import to_device
from minidist.comm import ProcessGrid, stats
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel.parallel_3d import Parallel3D, build_stage, expected_traffic
from minidist.parallel.tp_formulas import expected_bytes
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync
from minidist.plan.memory import activation_layer_bytes, best_every_k, recompute_peak_elements
from minidist.rng import DropoutRNG
from minidist.tensor import MEMORY, Tensor
from minidist.train import TrainConfig

TOLERANCE = 1e-12       # recomputation reruns the same arithmetic: equal, not close


def check_input(args, cfg, world):
    """Every rank finds the same answer: bad input ends the job with one message, exit 2."""
    pp = args.pp
    harness.need(world % pp == 0, f"--pp {pp} does not divide the {world} ranks")
    tp = args.tp or world // pp
    harness.need(tp * pp == world, f"--tp {tp} x --pp {pp} must be the world size ({world} ranks): this lesson "
                                   f"shows recomputation inside tensor and pipeline parallelism only (data "
                                   f"parallelism is lesson 02); this works: "
                                   f"{harness.command_with(tp * pp, harness.heads_fix(cfg.n_head, cfg.n_embd, tp))}")
    harness.need(pp <= cfg.n_layer, f"{pp} pipeline stages but only {cfg.n_layer} layers: every stage needs a layer")
    fewest = cfg.n_layer // pp                      # the smallest stage's blocks (all of them without --pp)
    harness.need(args.k is None or args.k <= fewest,
                 f"--k {args.k} is more than the {fewest} blocks " + ("of the smallest stage" if pp > 1 else
                 "of the model") + f": k > L would be one segment of all of them (--k {fewest} at most)")
    harness.need(pp == 1 or args.batch_size % args.micro_batches == 0,
                 f"--batch-size {args.batch_size} must split into --micro-batches {args.micro_batches} of equal size")
    harness.need(cfg.n_head % tp == 0, f"--n-head {cfg.n_head} is not divisible by the tensor-parallel size {tp}: "
                                       f"each rank takes whole heads; this works: "
                                       f"{harness.command_with(world, harness.heads_fix(cfg.n_head, cfg.n_embd, tp))}")
    harness.need(args.lr > 0, f"--lr must be positive, got {args.lr}")
    harness.need(all(L >= 1 for L in args.sweep), f"--sweep takes layer counts of at least 1, got {args.sweep}")
    return tp, pp


def build(cfg, seed, comm, policy, k):
    full = GPT(cfg, seed=seed)
    model = TensorParallelGPT(full, comm) if comm.Get_size() > 1 else full
    return model.set_recompute(policy, k)


def blocks_peak(model, b, seed):
    """The meter's peak over the blocks' forward and backward (from a non-scalar gradient,
    as a pipeline stage receives it): what recomputation changes, measured. A pipeline
    stage (--pp): its own blocks."""
    cfg = model.config
    blocks = model.blocks() if hasattr(model, "blocks") else model.transformer.h
    g = np.random.default_rng(seed)
    x = to_device(g.standard_normal((b, cfg.block_size, cfg.n_embd)).astype(cfg.dtype))   # the blocks' input
    leaf = Tensor(x, requires_grad=True)
    rng = DropoutRNG(seed, 0, range(b)) if cfg.dropout > 0 else None
    extra = (None,) if isinstance(model, TensorParallelGPT) else ()      # seq: no sequence parallelism
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    y = recompute.run_blocks(model.recompute, blocks, leaf.reshape(leaf.shape), rng, *extra)
    y.backward(to_device(g.standard_normal(y.shape).astype(cfg.dtype)))     # as a stage receives it
    return MEMORY.peak_bytes - base


def blocks_times(runs, b, seed, reps, comm):
    """Each policy's blocks, forward and backward, timed in turn, repeat after repeat (the
    part recomputation changes): a machine whose load drifts slows every policy alike, so
    the medians' ratios mean what they seem. Returns {policy: median seconds}."""
    times = {p: [] for p in runs}
    for turn in range(reps + 1):                   # turn 0 warms the caches up, untimed
        for policy, r in runs.items():
            comm.Barrier()
            t0 = time.perf_counter()
            blocks_peak(r["model"], b, seed)
            if turn:
                times[policy].append(common.mpi_reduce(comm, time.perf_counter() - t0, "max"))
    for r in runs.values():
        r["model"].zero_grad()
    return {p: float(np.median(t)) for p, t in times.items()}


# a block's forward again, over its forward and backward (backward = 2 forward): 1 + 1/3
EXPECTED_TIME = {"none": "1", "full": "~4/3", "every-k": "~4/3", "selective": "a little over 1"}


def count(cfg, policy, b, t, k, n_layer=None):
    item = np.dtype(cfg.dtype).itemsize
    return recompute_peak_elements(policy, n_layer or cfg.n_layer, b, cfg.block_size, cfg.n_embd, cfg.n_head,
                                   t=t, dropout=cfg.dropout > 0, k=k) * item


def run_policy(policy, cfg, args, data, tc, comm, grid=None):
    """Train under one policy: (losses, state, median step time, whole-step peak, bytes sent
    per step, the formula's bytes, model, optimizer). grid (--pp): lesson 07's stage, the
    TP all-reduces of the last step beside parallel_3d.expected_traffic's."""
    if grid is not None:
        model, tp_model = build_stage(GPT(cfg, seed=args.seed), grid, 1, policy, args.k)
        opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
        slot = Parallel3D(model, tp_model, grid, "1f1b", args.micro_batches, opt)
        MEMORY.reset_peak()
        base = MEMORY.live_bytes
        losses, state, times = common.train_and_collect(model, slot, data, args, tc, slice(None),
                                                        args.micro_batches, slot)
        peak = MEMORY.peak_bytes - base
        want = expected_traffic(slot, args.batch_size, cfg.block_size, clip=bool(args.grad_clip))["tp"]
        return (losses, state, float(np.median(times)), peak, slot.traffic["tp"].get("all_reduce", 0),
                want.get("all_reduce", 0), model, opt)
    model = build(cfg, args.seed, comm, policy, args.k)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    sync = TensorParallelSync(model) if isinstance(model, TensorParallelGPT) else None
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    with stats.measure() as m:
        losses, state, times = common.train_and_collect(model, opt, data, args, tc, dp=sync)
    peak = MEMORY.peak_bytes - base
    sent = m.bytes_sent("all_reduce") // args.steps
    again = cfg.n_layer if policy in ("full", "every-k") else 0
    want = expected_bytes(model, args.batch_size, cfg.block_size, clip=bool(args.grad_clip),
                          recomputed_layers=again).get("all_reduce", (0, 0))[1] if comm.Get_size() > 1 else 0
    return losses, state, float(np.median(times)), peak, sent, want, model, opt


# ------------------------------------------------------------------------------------- 1. the setup

def setup(args):
    """The input checked, the grid built (with --pp), the run described: the lesson's state,
    which the sections below read and add to."""
    comm = harness.comm_world()
    world = comm.Get_size()
    cfg = common.config_from_args(args, world)
    tp, pp = check_input(args, cfg, world)
    data = common.load_dataset(args, comm)
    grid = ProcessGrid(tp=tp, pp=pp, dp=1, comm=comm) if pp > 1 else None
    tp_comm = grid.tp_comm if grid is not None else comm
    L, b, s, h, a = cfg.n_layer, args.batch_size, cfg.block_size, cfg.n_embd, cfg.n_head
    k = args.k or recompute.default_k(L)
    policies = recompute.POLICIES if args.policy == "all" else ("none", args.policy)
    policies = tuple(dict.fromkeys(policies))
    say("Lesson 08: activation recomputation" + (f" inside tensor parallelism, tp={tp}" if tp > 1 and pp == 1 else
                                                  f" inside the pipeline, tp={tp} x pp={pp} (lesson 07's stages, 1F1B "
                                                  f"with m={args.micro_batches})" if pp > 1 else ", one process"))
    say(f"model   n_layer={L} n_head={a} n_embd={h} block_size={s} vocab={cfg.vocab_size} dropout={cfg.dropout} "
        f"{cfg.dtype};\n        batch {b} sequences; {args.steps} AdamW steps, clipping at {args.grad_clip}")
    say(f"policies {', '.join(policies)} (every-k: a checkpoint per k={k if pp == 1 else args.k or 'round(sqrt(L_r))'}"
        f" blocks" + ((", round(sqrt(L))" if pp == 1 else " of each stage's L_r") if not args.k else "") + ")\n")
    tc = TrainConfig(batch_size=b, max_iters=args.steps, learning_rate=args.lr, min_lr=args.lr / 10,
                     warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    return SimpleNamespace(args=args, comm=comm, world=world, cfg=cfg, tp=tp, pp=pp, data=data, grid=grid,
                           tp_comm=tp_comm, L=L, b=b, s=s, h=h, a=a, k=k, policies=policies, tc=tc,
                           item=np.dtype(cfg.dtype).itemsize, ok=True, figures={})


# -------------------------------------------------------------------------- 2. every policy trained

def policy_runs(run):
    """Train under each policy; each one's blocks' peak measured beside the engine's count, its
    losses, raw gradients and weights against none's."""
    args, cfg, comm, world, pp, b = run.args, run.cfg, run.comm, run.world, run.pp, run.b
    runs = run.runs = {}
    for policy in run.policies:
        losses, state, t, peak, sent, bytes_want, model, opt = run_policy(policy, cfg, args, run.data, run.tc,
                                                                          comm, run.grid)
        # a pipeline stage: its L_r blocks, one micro-batch of b/m rows, its own every-k k
        L_r, b_r = (len(model.blocks()), b // args.micro_batches) if pp > 1 else (run.L, b)
        body = blocks_peak(model, b_r, args.seed)
        want = count(cfg, policy, b_r, run.tp, model.recompute.k if pp > 1 else run.k, n_layer=L_r)
        if pp > 1:                                 # every rank's measured and counted peak, for the table
            per_rank = common.mpi_reduce(comm, [x if r == comm.Get_rank() else 0 for r in range(world)
                                                for x in (body, want, L_r)], "sum").reshape(world, 3)
        state["loss"] = np.array(losses)
        runs[policy] = dict(losses=losses, state=state, time=common.mpi_reduce(comm, t), body=body, count=want,
                            equal=bool(common.mpi_reduce(comm, float(body != want)) == 0),
                            step_peak=int(common.mpi_reduce(comm, peak)), sent=int(common.mpi_reduce(comm, sent)),
                            sent_want=int(common.mpi_reduce(comm, bytes_want)), model=model, opt=opt,
                            per_rank=per_rank if pp > 1 else None, L_r=L_r, b_r=b_r,
                            bytes_equal=bool(common.mpi_reduce(comm, float(sent != bytes_want)) == 0))
    run.ref = ref = runs["none"]
    for policy, r in runs.items():
        rel, absd, worst = harness.compare(r["state"], ref["state"])
        r["rel"], r["abs"] = common.mpi_reduce(comm, [rel, absd])
        r["worst"] = worst
        r["bytes_ok"] = r["bytes_equal"]                # on every rank: its measured bytes = its formula
        run.ok &= r["rel"] <= TOLERANCE and r["equal"] and r["bytes_ok"]


# ------------------------------------------------------------------- 3. memory and time, per policy

def memory_time_section(run):
    """The blocks' peak per policy beside the engine's count and the paper's per-layer figure,
    then the blocks' time and the step's beside the expected ratio."""
    args, cfg, runs, ref = run.args, run.cfg, run.runs, run.ref
    s, h, a, tp, pp = run.s, run.h, run.a, run.tp, run.pp
    L0, b0 = ref["L_r"], ref["b_r"]                    # rank 0's: with --pp, the first stage's blocks, a micro-batch
    say(f"activation memory per rank: the meter's peak over the {L0} blocks' forward and backward\n(b={b0} s={s} h={h} "
        f"a={a}" + (f" t={tp}" if tp > 1 else "") + ")" + (" on rank 0, the first stage; every rank below" if pp > 1 else ""))
    blocks_t = blocks_times(runs, b0, args.seed, args.timing_reps, run.comm)
    rows = []
    paper_name = {"none": "none", "selective": "selective", "full": "full"}
    for policy, r in runs.items():
        r["blocks_time"] = blocks_t[policy]
        paper = activation_layer_bytes(s, b0, h, a, tp, False, paper_name[policy]) * L0 if policy in paper_name else None
        rows.append([policy, fmt_bytes(r["body"]), fmt_bytes(r["count"]), "equal" if r["equal"] else "DIFFERENT",
                     f"{r['body'] / ref['body']:.2f}", fmt_bytes(paper) if paper else "-", fmt_bytes(r["step_peak"]),
                     EXPECTED_TIME.get(policy, "-"), f"{blocks_t[policy] / blocks_t['none']:.2f}x",
                     f"{blocks_t[policy] * 1e3:.1f}", f"{r['time'] * 1e3:.1f}", f"{r['rel']:.1e}"])
    # two tables, memory then time and agreement: side by side they are too wide to read
    harness.table([r[:7] for r in rows], header=["policy", "blocks: measured", "engine's count", "", "/ none",
                                                 f"paper, {L0} layers", "whole step peak"])
    say(f"\ntime: the blocks' forward + backward, the policies taken in turn {args.timing_reps} times (median);"
        f"\nthe whole training step's median beside it")
    harness.table([r[:1] + r[7:] for r in rows], header=["policy", "expected / none", "measured / none",
                                                         "blocks ms", "step ms", "max_rel_diff"])
    x = b0 * s * h * run.item
    A = count(cfg, "none", b0, tp, run.k, n_layer=1)
    say(f"  one block's input x = b*s*h = {fmt_bytes(x)}, one block's saves A = {fmt_bytes(A)} (this engine, {cfg.dtype})")
    say("  full: L x + A (the inputs kept, one block rebuilt at a time); every-k: max over segments j of\n"
        "  (j+1) x + k A; selective: q, k, v kept in place of the b*a*s*s probabilities and mask;\n  the paper's "
        "34sbh + 5as^2b, 34sbh and 2sbh per layer assume 16-bit values and 1-byte masks\n"
        "  (docs/reference.md#activation-memory-per-layer)")
    say("  time: full and every-k run each block's forward twice (one forward more over a forward and a\n"
        "  backward of two: ~4/3); selective reruns only the attention core. Ranks that share cores\n"
        "  (more ranks than cores, or a busy machine) make one run's ratios differ from the next by 10% or\n"
        "  more: read the expected column first, the measured one as this machine's sample of it")


def ranks_bytes_section(run):
    """With --pp, every rank's stage peak beside its count; with --tp, the all-reduce bytes
    each rank sent beside expected_bytes (the rerun repeats the forward's collectives)."""
    runs, ref, tp, pp = run.runs, run.ref, run.tp, run.pp
    if pp > 1:
        say(f"\nevery rank's peak over its stage's blocks, one micro-batch of b={ref['b_r']} (measured = count for its "
            f"L_r; every-k's k = round(sqrt(L_r)) unless --k)")
        harness.table([[rank, *run.grid.coords(rank)[1:], int(ref["per_rank"][rank, 2])]
                       + [fmt_bytes(r["per_rank"][rank, 0]) + (" =" if r["per_rank"][rank, 0] == r["per_rank"][rank, 1]
                                                              else " != " + fmt_bytes(r["per_rank"][rank, 1]))
                          for r in runs.values()] for rank in range(run.world)],
                      header=["rank", "pp", "tp", "L_r"] + list(runs))
    if tp > 1:
        say("\nbytes each rank sends per step (all-reduces): the rerun repeats each layer's 2 forward g's"
            + (" (the largest over ranks;\n  each rank's equal to its tp group's in parallel_3d.expected_traffic)" if pp > 1 else ""))
        harness.table([[p, f"{r['sent']:,}", f"{r['sent_want']:,}", "equal" if r["bytes_ok"] else "DIFFERENT"]
                       for p, r in runs.items()], header=["policy", "measured", "expected_bytes", ""])


# ------------------------------------------------------------------------------ 4. the sweep over L

def sweep_section(run):
    """L blocks without recomputation and with a checkpoint every sqrt(L): memory grows as L
    and as sqrt(L)."""
    args, cfg, comm, b, tp, pp = run.args, run.cfg, run.comm, run.b, run.tp, run.pp
    say(f"\nsweep over n_layer: the blocks' peak without recomputation and with every-sqrt(L) checkpoints\n(b={b}"
        + (f", t={tp}" if tp > 1 else "") + ((", no pipeline: all L blocks on " + ("one tp group" if tp > 1 else "one rank")) if pp > 1 else "") + ")")
    sweep_rows = []
    for n in args.sweep:
        c = type(cfg)(**{**cfg.__dict__, "n_layer": n})
        kn = recompute.default_k(n)
        none = blocks_peak(build(c, args.seed, run.tp_comm, "none", None), b, args.seed)
        every = blocks_peak(build(c, args.seed, run.tp_comm, "every-k", kn), b, args.seed)
        same = none == count(c, "none", b, tp, kn) and every == count(c, "every-k", b, tp, kn)
        run.ok &= bool(common.mpi_reduce(comm, float(not same)) == 0)
        sweep_rows.append([n, kn, fmt_bytes(none), fmt_bytes(none / n), fmt_bytes(every),
                           fmt_bytes(every / math.sqrt(n)), "equal" if same else "DIFFERENT"])
        run.figures.update({f"sweep_L{n}_none_bytes": none, f"sweep_L{n}_every_sqrt_L_bytes": every})
    harness.table(sweep_rows, header=["L", "k", "none", "none / L", "every-k", "every-k / sqrt(L)", "vs count"])
    say("  none / L stays constant (memory grows as L); every-k / sqrt(L) stays about constant\n"
        "  (grows as sqrt(L))")


# ----------------------------------------------------------------------- 5. which k keeps the least

def best_k_section(run):
    """Every k at this L measured: every-k's (L/k) x + k A is least at k = sqrt(L x / A), not
    sqrt(L)."""
    args, cfg, comm, L, b, tp, pp = run.args, run.cfg, run.comm, run.L, run.b, run.tp, run.pp
    scan = []
    for kk in range(1, L + 1):
        got = blocks_peak(build(cfg, args.seed, run.tp_comm, "every-k", kk), b, args.seed)
        run.ok &= bool(common.mpi_reduce(comm, float(got != count(cfg, "every-k", b, tp, kk))) == 0)
        scan.append(got)
    best = 1 + int(np.argmin(scan))
    xb, Ab = b * run.s * run.h * run.item, count(cfg, "none", b, tp, None, n_layer=1)
    k_formula = best_every_k(L, xb, Ab)
    say(f"\nevery-k at L={L} (b={b}" + (f", t={tp}" if tp > 1 else "") + (", no pipeline" if pp > 1 else "")
        + "): the blocks' peak, measured (= count), for each k")
    cells = [f"k={kk} {fmt_bytes(v)}" for kk, v in enumerate(scan, 1)]
    for i in range(0, L, 6):
        say("  " + ", ".join(cells[i:i + 6]))
    say(f"  least at k = {best} measured; (L/k) x + k A is least at k = sqrt(L x / A)\n"
        f"  = sqrt({L} x {fmt_bytes(xb)} / {fmt_bytes(Ab)}) = {k_formula:.2f}, not Chen's sqrt(L) = "
        f"{math.sqrt(L):.2f}, which assumes\n  a checkpoint costs about a block's saves (x ~ A)."
        + (" Here x << A: full (k = 1) keeps the least,\n  and every-k, at full's compute (every block rerun once), "
           "lies between full and none in memory" if xb * L < 2.25 * Ab else ""))
    run.figures.update({f"every_k_L{L}_k{kk}_bytes": v for kk, v in enumerate(scan, 1)})
    run.figures["every_k_best_k_measured"] = best
    run.figures["every_k_best_k_formula"] = k_formula


# ------------------------------------------------------------------------------------ 6. the report

def report_section(run):
    """The figures, the last policy's memory and the verdict."""
    args, comm, runs, ref, figures, tp, pp = run.args, run.comm, run.runs, run.ref, run.figures, run.tp, run.pp
    for policy, r in runs.items():
        key = policy.replace("-", "_")
        figures.update({f"{key}_blocks_peak_bytes_measured": r["body"], f"{key}_blocks_peak_bytes_count": r["count"],
                        f"{key}_step_peak_bytes": r["step_peak"], f"{key}_step_time_s": r["time"],
                        f"{key}_time_ratio": r["time"] / ref["time"], f"{key}_max_rel_diff": r["rel"],
                        f"{key}_blocks_time_s": r["blocks_time"],
                        f"{key}_blocks_time_ratio": r["blocks_time"] / ref["blocks_time"]})
        if pp > 1:                                 # every rank's stage: measured and counted
            figures.update({f"{key}_rank_blocks_peak_bytes_measured": [int(v) for v in r["per_rank"][:, 0]],
                            f"{key}_rank_blocks_peak_bytes_count": [int(v) for v in r["per_rank"][:, 1]]})
    shown = run.policies[-1]
    r = runs[shown]
    rel = max(x["rel"] for x in runs.values())
    absd = max(x["abs"] for x in runs.values())
    mem = {"params": int(common.mpi_reduce(comm, sum(p.data.nbytes for p in r["model"].parameters()))),
           "grads": int(common.mpi_reduce(comm, sum(p.grad.nbytes for p in r["model"].parameters()
                                                    if p.grad is not None))),
           "optimizer": int(common.mpi_reduce(comm, r["opt"].state_bytes())), "activations_peak": r["step_peak"]}
    report = harness.new_report(
        "08_activation_recompute", args, parallel={"tp": tp, "dp": 1, "pp": pp, "recompute": shown, "k": run.k},
        match=bool(run.ok), max_rel_diff=rel, max_abs_diff=absd, tolerance=TOLERANCE,
        losses={"reference": ref["losses"], "parallel": r["losses"]},
        comm={"bytes_sent": {"all_reduce": r["sent"]}, "expected_bytes": {"all_reduce": r["sent_want"]}} if tp > 1
        else None, memory=mem, step_time_s=r["time"], figures=figures)
    say("\nthe verdict needs: every policy's losses, raw gradients and weights equal to none's (1e-12), every\n"
        "measured peak equal to this engine's count" + (", bytes equal to expected_bytes" if tp > 1 else ""))
    return report


def main(args):
    run = setup(args)
    policy_runs(run)
    memory_time_section(run)
    ranks_bytes_section(run)
    sweep_section(run)
    best_k_section(run)
    return harness.finish(report_section(run), args)


def layer_list(text):
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts such as 4,9,16, got {text!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected layer counts of at least 1, got {text!r}")
    return out


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=4, n_head=4, n_embd=64, block_size=32, batch_size=8, dropout=0.1)
    p.add_argument("--policy", choices=("all",) + recompute.POLICIES[1:], default="all",
                   help="the policy compared with none (default: all of them)")
    p.add_argument("--k", type=harness.positive_int, help="blocks per checkpoint for every-k (default round(sqrt(L)))")
    p.add_argument("--tp", type=harness.positive_int, help="tensor-parallel size (default: the world size / --pp)")
    p.add_argument("--pp", type=harness.positive_int, default=1, help="pipeline stages (lesson 07's path; default 1)")
    p.add_argument("--micro-batches", type=harness.positive_int, default=4, metavar="M",
                   help="micro-batches per step with --pp (default %(default)s)")
    p.add_argument("--timing-reps", type=harness.positive_int, default=5,
                   help="turns of the interleaved timing of the policies (default %(default)s)")
    p.add_argument("--sweep", type=layer_list, default=[4, 9, 16], help="layer counts of the sweep (default 4,9,16)")
    common.add_step_flags(p)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
