"""The planner against a time-scaled cluster on this machine (lesson 12, section 7).

    mpirun -n 8 python -m minidist.lessons.12_plan --measure

It lives with the lessons, not in minidist/plan/: it trains lesson 07's model with its
parser and checks (MPI, the engine, lessons.common), while plan/ is arithmetic that
imports nothing of minidist's outside itself and runs without mpi4py.

Lesson 07's 3D training runs under the link model of minidist/comm/links.py (8 ranks as
2 simulated nodes of 4) for every factorisation tp x pp x dp of the world that lesson 07
allows, with ZeRO-1 over dp; each step is timed (a barrier before it, the slowest rank's
time, the median of the steps after warm-up). The planner (cost.estimate) predicts the
same layouts with this CPU as the "GPU" and a Cluster whose links are the link model's
(cpu_cluster); the two rankings are compared with Spearman's rank correlation (Spearman
1904; tied values take their mean rank).

The time scale: the real cluster's bandwidths (cluster.GPUS, H100 SXM nodes by default)
divided by X = (its GPU's dense peak) / (this CPU's FLOP/s per rank, all ranks at once),
so a byte costs as many FLOPs here as there (links.py). `ease` divides X by a constant for
a quicker look (1, the default, is the literal scale; the toy model moves far more bytes
per FLOP than a real one, so its layouts are communication-bound).

What the prediction is built from, all measured here before the layouts run:
  peak      FLOP/s per rank of the model's own largest matrix product, every rank at once
  efficiency  the planner's compute time set equal to a step of the whole model on each
            rank alone (layout 1 x 1 x N without communication): one constant for every
            layout, which takes in the engine's Python time per op
  HBM       memory bandwidth per rank (c = a + b), every rank at once
  alpha     this machine's own cost per ring step (MPI between processes on shared cores),
            added to the link model's alpha (0)
  placement the simulated nodes hold GPUs in Megatron's order (tp, dp, pp), as cost.py
            assumes, though lesson 07's grid numbers its ranks tp, pp, dp
What the planner does not model of lesson 07's run (each seen in the ratios): the ZeRO-1
reduce-scatter runs after the last backward here, where cost.py overlaps it with that
backward; a pipeline boundary across nodes carries the whole b s h from each TP rank here,
1/t in cost.py (Megatron's scatter/gather); the clipping norm's all-reduce and each
collective's shape check; and, on shared cores, the
idle stages of a pipeline lend their cores to the busy ones, so the bubble costs less
here than on GPUs of fixed speed.

The bytes, though, are counted exactly: each layout's bytes per group from lesson 07's
counters beside Estimate.bytes_sent (bytes_row, on one node: one_node).
This machine's figures and the Cluster built from them: lessons/cpu_cluster.py.

Run on its own: run(comm) returns the rows; table(result) formats them. Rank 0 shows one
progress line over the layouts (minidist.progress: updating, with the time left, on a
terminal; a plain line per layout otherwise).
"""
import importlib
import os
import time

import numpy as np
from mpi4py import MPI

from minidist.comm import links as linkmodel
from minidist.lessons.cpu_cluster import (cpu_cluster, machine_alpha, megatron_placement, one_node,
                                          stream_bandwidth, sustained_flops)
from minidist.progress import WIDTH, Progress, clock

# The model every layout runs (8 heads and 8 layers: every tp and pp of 8 ranks divides them).
SHAPE = dict(n_layer=8, n_head=8, n_embd=64, block_size=64, batch_size=16, dtype="float32")
# The literal time scale divided by this (module docstring); 1: the real cluster's ratio.
EASE = 1.0


def factorisations(size):
    """Every (tp, pp, dp) with tp * pp * dp == size, tp fastest-growing first."""
    return [(t, p, size // (t * p)) for t in range(1, size + 1) if size % t == 0
            for p in range(1, size // t + 1) if (size // t) % p == 0]


def _lesson07():
    return importlib.import_module("minidist.lessons.07_3d_parallel")


def lesson_args(tp, pp, dp, shape=SHAPE, steps=4, zero=1):
    """Lesson 07's own flags for one layout (its parser, so its defaults and checks hold)."""
    flags = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--steps", str(steps),
             "--zero", str(zero)]
    for k, v in shape.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return _lesson07().build_parser().parse_args(flags)


def time_layout(comm, tp, pp, dp, shape=SHAPE, steps=3, warmup=1, zero=1, charged=None, sent=None):
    """Seconds per training step of lesson 07's 3D run at tp x pp x dp on comm (wrapped or
    not): each step starts after a barrier on the unwrapped communicator and lasts until
    the slowest rank ends it; the median of the steps after `warmup`. Also returns m.
    zero=1: ZeRO-1 over dp (one reduce-scatter and one all-gather of a flat buffer, as the
    planner counts; plain averaging all-reduces every parameter apart). charged: a dict
    to fill, on a wrapped comm, with this rank's link delays per timed step by link class
    ({"intra": seconds, "inter": seconds}). sent: a dict to fill with every rank's bytes of
    the last step by group, {(tp_rank, pp_rank, dp_rank): {"tp", "pp", "dp"}}, from the
    strategy's own counters (Parallel3D.traffic; the clipping norm's group left out)."""
    from minidist.comm import ProcessGrid
    from minidist.lessons import common
    from minidist.model import GPT
    from minidist.parallel.parallel_3d import Parallel3D, build_stage
    from minidist.parallel.zero import ZeRO
    from minidist.train import TrainConfig, get_lr, micro_batches, train_step
    l07 = _lesson07()
    args = lesson_args(tp, pp, dp, shape, steps + warmup, zero)
    cfg = common.config_from_args(args, comm.Get_size())
    tp, pp, dp, v, m = l07.check_input(args, cfg, comm.Get_size())
    data = common.load_dataset(args, comm)
    grid = ProcessGrid(tp=tp, pp=pp, dp=dp, comm=comm)
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    stage, tp_model = build_stage(GPT(cfg, seed=args.seed), grid, v)
    opt = stage.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    zero = ZeRO(stage, opt, grid.dp_comm, 1) if args.zero else None
    slot = Parallel3D(stage, tp_model, grid, args.schedule, m, opt, zero)
    per_dp = args.batch_size // dp
    rows = slice(grid.dp_rank * per_dp, (grid.dp_rank + 1) * per_dp)
    base = linkmodel.unwrap(comm)
    times = []
    links = comm.links if isinstance(comm, linkmodel.LinkedComm) else None
    for step in range(args.steps):
        if links is not None and step == warmup:
            links.reset()                  # count the timed steps only
        x, y = data.get_batch("train", args.batch_size, step)
        batches = micro_batches(x[rows], y[rows], step, args.seed, m, first_sample=rows.start)
        base.Barrier()
        t0 = time.perf_counter()
        train_step(stage, slot, batches, get_lr(step, tc), tc.grad_clip, dp=slot)
        took = np.array([time.perf_counter() - t0])
        slowest = np.empty(1)
        base.Allreduce(took, slowest, op=MPI.MAX)
        times.append(float(slowest[0]))
    if sent is not None:
        mine = [grid.tp_comm.Get_rank(), grid.pp_comm.Get_rank(), grid.dp_comm.Get_rank()]
        mine += [sum(slot.traffic[g].values()) for g in GROUPS]
        every = np.empty((comm.Get_size(), len(mine)))
        base.Allgather(np.array(mine, dtype=float), every)
        sent.update({tuple(int(x) for x in row[:3]): dict(zip(GROUPS, (int(x) for x in row[3:])))
                     for row in every})
    grid.free()
    if charged is not None and links is not None:
        charged.update({c: v[2] / steps for c, v in links.counts.items()})
    return float(np.median(times[warmup:])), m


def spearman(xs, ys):
    """Spearman's rank correlation: Pearson's correlation of the ranks, tied values
    taking the mean of the ranks they span (Spearman 1904). None when a side is constant."""
    def ranks(v):
        v = list(v)
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1      # ranks i+1..j+1, their mean
            i = j + 1
        return r
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} values against {len(ys)}")
    rx, ry = ranks(xs), ranks(ys)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


def predict(cluster, tp, pp, dp, m, shape=SHAPE, precision="zero"):
    """cost.estimate of lesson 07's run at tp x pp x dp, m micro-batches, ZeRO-1 over dp.
    precision "zero" times it (16-bit values, bandwidths scaled to match: cpu_cluster);
    "fp32" counts the bytes this float32 run sends (Estimate.bytes_sent)."""
    from minidist.plan.cost import estimate
    from minidist.plan.layout import Layout, Model
    model = Model(shape["n_layer"], shape["n_embd"], shape["n_head"], 256, shape["block_size"],
                  shape["batch_size"])
    layout = Layout(tp, pp, dp, shape["batch_size"] // (dp * m), zero=1, precision=precision)
    return estimate(model, cluster, layout)


GROUPS = ("tp", "pp", "dp")


def bytes_row(est, sent):
    """(planned, measured) bytes by group for the GPU the planner speaks for: the first
    rank (tp 0, dp 0) of the stage est.bytes_stage."""
    planned = {g: int(est.bytes_sent.get(g, 0)) for g in GROUPS}
    return planned, sent[(0, est.bytes_stage, 0)]


def efficiency(comm, flops, hbm, itemsize, shape=SHAPE, steps=3):
    """The one matmul efficiency of this CPU's "GPU", measured: every rank trains the whole
    model alone (MPI.COMM_SELF, no communication) on its share of the batch, all ranks at
    once, as layout 1 x 1 x N computes; the efficiency is what makes the planner's compute
    time equal that step: matrix-product seconds at efficiency 1 over the measured time
    less the elementwise and optimizer parts. It takes in what the planner leaves out at
    these small sizes (the engine's Python time per op): one constant, for every layout."""
    size = comm.Get_size()
    comm.Barrier()
    share = dict(shape, batch_size=shape["batch_size"] // size)
    took, m = time_layout(MPI.COMM_SELF, 1, 1, 1, share, steps, 1)
    mine, slowest = np.array([took]), np.empty(1)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    links = linkmodel.Links(1, size, (0.0, 1.0))
    est = predict(cpu_cluster(flops, hbm, links, 0.0, itemsize, size), 1, 1, size, m, shape)
    matmul = est.compute_s - est.elementwise_s
    rest = est.elementwise_s + est.optimizer_s
    return min(1.0, matmul / max(float(slowest[0]) - rest, 1e-12)), float(slowest[0])


def layout_problem(tp, pp, dp, shape=SHAPE, size=8):
    """Why lesson 07 refuses this layout for the shape (its own check_input), or None."""
    from minidist.lessons import common
    from minidist.lessons.harness import InputError
    args = lesson_args(tp, pp, dp, shape)
    try:
        _lesson07().check_input(args, common.config_from_args(args, size), size)
    except InputError as e:
        return str(e)
    return None


def micro_batches(tp, pp, dp, shape=SHAPE, size=8):
    """The micro-batches lesson 07 runs at tp x pp x dp (its own check_input)."""
    from minidist.lessons import common
    args = lesson_args(tp, pp, dp, shape)
    return _lesson07().check_input(args, common.config_from_args(args, size), size)[4]


class Ahead(Progress):
    """The layouts' progress line, its time left weighted by each layout's predicted step:
    elapsed x (predicted seconds of the layouts left) / (of those done). The layouts differ
    thirty-fold (8 x 1 x 1, last, takes about half the run), so a count alone would say
    seconds are left when minutes are."""

    def __init__(self, weights, label, **kw):
        super().__init__(len(weights), label, **kw)
        self.weights = list(weights)

    def line(self, done, text=""):
        s = super().line(done, text)
        if 0 < done < self.total:
            spent = self.clock() - self.start
            left = spent * sum(self.weights[done:]) / sum(self.weights[:done])
            s = (s.rpartition("  ~ ")[0] + f"  ~ {clock(left)} left")[:WIDTH]
        return s


def run(comm, shape=SHAPE, gpu="h100-sxm", per_node=4, ease=EASE, steps=3, warmup=1, wait="sleep"):
    """Measure and predict every layout lesson 07 allows on comm's ranks; see the module
    docstring. Every rank calls it; every rank gets the same dict:
      measured: [{tp, pp, dp, micro_batches, measured_step_s, predicted_step_s,
                  link_delay_s (the most link delay one rank waited per step), predicted
                  parts}], spearman, best_measured, best_predicted_two,
      best_in_predicted_two, and what the cluster was built from."""
    from minidist.plan.cluster import GPUS
    comm = linkmodel.unwrap(comm)          # the lesson's world may come wrapped (MINIDIST_LINKS)
    size = comm.Get_size()
    if size % per_node:
        raise ValueError(f"{size} ranks do not fill nodes of {per_node}")
    itemsize = np.dtype(shape["dtype"]).itemsize
    rows = shape["batch_size"] // min(4, shape["batch_size"])
    flops = sustained_flops(comm, n=shape["n_embd"] * 4, m=rows * shape["block_size"],
                            k=shape["n_embd"], dtype=shape["dtype"])
    hbm = stream_bandwidth(comm)
    load = np.array(os.getloadavg()[:1])
    comm.Bcast(load, root=0)               # the machine's load when the run began (rank 0's)
    # this machine's cost per ring step, waiting as the runs will wait (no delay: bandwidth inf)
    no_delay = linkmodel.Links(1, size, (0.0, float("inf")), wait=wait)
    alpha = machine_alpha(linkmodel.LinkedComm(comm, no_delay))
    eff, alone = efficiency(comm, flops, hbm, itemsize, shape)
    real = GPUS[gpu]
    literal = real.peak_flops / flops               # the time scale that keeps the ratio (links.py)
    scale = literal / ease
    out = []
    todo = [f for f in factorisations(size) if not layout_problem(*f, shape, size)]

    def scaled_links(tp, pp, dp):
        return linkmodel.Links(size // per_node, per_node, (0.0, real.intra_bw),
                               (0.0, real.inter_bw), scale, wait,
                               placement=megatron_placement(tp, pp, dp, per_node))
    ahead = [predict(cpu_cluster(flops, hbm, scaled_links(*f), alpha, itemsize, size, eff), *f,
                     micro_batches(*f, shape, size), shape).step_time_s for f in todo]
    bar = Ahead(ahead, "   layouts", every=1) if comm.Get_rank() == 0 else None
    for tp, pp, dp in todo:
        links = scaled_links(tp, pp, dp)
        charged, sent = {}, {}
        took, m = time_layout(linkmodel.LinkedComm(comm, links), tp, pp, dp, shape, steps, warmup,
                              charged=charged, sent=sent)
        waited, most = np.array([sum(charged.values())]), np.empty(1)
        comm.Allreduce(waited, most, op=MPI.MAX)
        cluster = cpu_cluster(flops, hbm, links, alpha, itemsize, size, eff)
        est = predict(cluster, tp, pp, dp, m, shape)
        planned, counted = bytes_row(predict(one_node(cluster), tp, pp, dp, m, shape, "fp32"), sent)
        out.append({"tp": tp, "pp": pp, "dp": dp, "micro_batches": m, "measured_step_s": took,
                    "bytes_planned": planned, "bytes_measured": counted,
                    "bytes_match": planned == counted,
                    "predicted_step_s": est.step_time_s, "link_delay_s": float(most[0]),
                    "predicted": {k: getattr(est, k) for k in ("compute_s", "tp_s", "pp_s", "dp_s",
                                                               "bubble_s", "optimizer_s")}})
        if bar is not None:
            bar.update(len(out), f"{tp} x {pp} x {dp}: {took:.3g} s per step")
    if bar is not None:
        bar.close()
    name = lambda r: f"{r['tp']}x{r['pp']}x{r['dp']}"      # noqa: E731
    by_measured = sorted(out, key=lambda r: r["measured_step_s"])
    by_predicted = sorted(out, key=lambda r: r["predicted_step_s"])
    best, two = name(by_measured[0]), [name(r) for r in by_predicted[:2]]
    rho = spearman([r["measured_step_s"] for r in out], [r["predicted_step_s"] for r in out])
    return {"measured": out, "spearman": rho, "bytes_match": all(r["bytes_match"] for r in out),
            "best_measured": best, "best_predicted_two": two, "best_in_predicted_two": best in two,
            "shape": dict(shape), "gpu": gpu, "cpu_flops_per_rank": flops,
            "cpu_memory_bytes_per_s": hbm, "load_average": float(load[0]),
            "machine_alpha_s": alpha, "efficiency": eff, "step_alone_s": alone,
            "scale_literal": literal, "ease": ease, "scale": scale,
            "links": links.spec() if out else None, "placement": "megatron (tp, dp, pp)",
            "wait": wait, "steps": steps, "warmup": warmup}


PARTS = ("compute_s", "tp_s", "pp_s", "dp_s", "bubble_s")


def table(result):
    """run()'s result as text lines of at most 100 columns: each layout's measured and
    predicted step (seconds, 3 significant digits), their ratio, the two ranks, and the
    predicted parts."""
    g = lambda x: f"{x:8.3g}"      # noqa: E731  (8 columns for any magnitude)
    lines = ["  layout      m  measured predicted  ratio  rank m/p" + "".join(
                 f"{k[:-2]:>8}" for k in PARTS) + " bytes",
             "  " + "-" * 98]
    rows = result["measured"]
    meas = sorted(range(len(rows)), key=lambda i: rows[i]["measured_step_s"])
    pred = sorted(range(len(rows)), key=lambda i: rows[i]["predicted_step_s"])
    for i, r in enumerate(rows):
        name = f"{r['tp']} x {r['pp']} x {r['dp']}"
        got, want = r["measured_step_s"], r["predicted_step_s"]
        lines.append(f"  {name:<10}{r['micro_batches']:>3}  {g(got)}s {g(want)}s{got / want:>7.2f}"
                     f"{meas.index(i) + 1:>6} /{pred.index(i) + 1:>2}"
                     + "".join(g(r["predicted"][k]) for k in PARTS)
                     + ("      =" if r.get("bytes_match") else "   DIFF"))
    diff = [f"{r['tp']}x{r['pp']}x{r['dp']}" for r in rows if not r.get("bytes_match")]
    lines.append("  bytes: each layout's bytes per step in its tp, pp and dp groups, counted by lesson 07's")
    lines.append("  counters and by the planner (Estimate.bytes_sent, one node): "
                 + ("equal on every layout (=)" if not diff else "DIFFERENT on " + ", ".join(diff)))
    rho = result["spearman"]
    rho = "-" if rho is None else f"{rho:.3f}"
    two = result["best_predicted_two"]
    lines.append(f"  Spearman's rank correlation {rho} (goal >= 0.8); "
                 f"measured best {result['best_measured']},")
    lines.append(f"  predicted best two {', '.join(two)}: the measured best is "
                 + ("among them" if result["best_measured"] in two else "NOT among them"))
    return lines
