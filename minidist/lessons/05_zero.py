"""Lesson 05: ZeRO. Data parallelism without the copies: optimizer state (stage 1), then
gradients (stage 2), then the weights (stage 3) partitioned across the ranks; the run
must still equal one process training on the whole batch.

    mpirun -n 4 python -m minidist.lessons.05_zero --stage 3
    mpirun -n 4 python -m minidist.lessons.05_zero --stage all --json out.json
    mpirun -n 3 python -m minidist.lessons.05_zero --stage 2 --overlap --grad-accum 2

Each stage trains a few AdamW steps (clipping by the global norm of the shards) from the
same seed as a single-process reference; compared: losses, each rank's partition of the
raw gradients of every step against the same slice of the reference's, and the weights
(stage 3: each rank's shard). Then, per rank, memory measured from the arrays it holds
beside the paper's count for this dtype, and the bytes it sent beside (N-1)/N x 2 Psi
(stages 0-2) or 3 Psi (stage 3). Stage 0 is lesson 02's bucketed data parallelism.
"""
import textwrap
import time

import numpy as np
from mpi4py import MPI

from minidist import backend, equivalence
from minidist.comm import staging, stats
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel.data_parallel import BucketedDataParallel
from minidist.parallel.fsdp import Units
from minidist.parallel.zero import ZeRO, expected_sent, reference_slice
from minidist.plan.memory import engine_state_bytes, zero_grad_peak_bytes
from minidist.plan.traffic import dp_sent, zero_bytes
from minidist.tensor import MEMORY
from minidist.train import TrainConfig


def make_run(args, cfg):
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    model = GPT(cfg, seed=args.seed)
    return model, model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2)), tc


def run_stage(stage, overlap, args, cfg, data, rows, comm, ref):
    """Train one stage; return its row of figures (all reduced over ranks: the largest)."""
    world = comm.Get_size()
    model, opt, tc = make_run(args, cfg)
    if stage == 0:
        dp = BucketedDataParallel(model, comm, bucket_bytes=args.bucket_kb * 1024)
        runner = opt
    else:
        units = Units(model, comm) if stage == 3 else None     # stage 3: FSDP's units, resharded, no prefetch
        dp = runner = ZeRO(model, opt, comm, stage=stage, bucket_bytes=args.bucket_kb * 1024, overlap=overlap,
                           units=units)
    MEMORY.reset_peak()
    with stats.measure() as m:
        losses, state, times = common.train_and_collect(model, runner, data, args, tc, rows, args.grad_accum, dp)
    moved = equivalence.host_device_bytes_per_step()     # this stage's run (0 on the CPU)
    state["loss"] = common.mpi_reduce(comm, losses, "sum") / world
    ref_state = {k: reference_slice(k, ref[1]) for k in state if k != "loss"}
    ref_state["loss"] = np.array(ref[0])
    rel, abs_diff, _ = harness.compare(state, ref_state)
    item = np.dtype(cfg.dtype).itemsize
    psi = sum(p.size for p in model.parameters()) if stage < 3 else sum(g.n for g in dp.groups)
    names = ("reduce_scatter", "all_gather") if stage else ("all_reduce",)
    sent = {c: int(common.mpi_reduce(comm, m.bytes_sent(c) // args.steps)) for c in names}
    if stage == 0:
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        mem = {"params": sum(p.data.nbytes for p in model.parameters()), "grads": grads,
               "optimizer": opt.state_bytes()}
        split = {"full": grads, "partitions": 0, "in_flight": 0}
        bucket_sizes = [b.flat.size for b in dp.buckets]   # one ring all-reduce per bucket
        exact = {"all_reduce": int(common.mpi_reduce(comm, dp_sent(bucket_sizes, world, comm.Get_rank(), item)[1]))}
    else:
        mem = dp.memory()
        split = dp.peak_grad_split
        exact = {c: int(common.mpi_reduce(comm, v)) for c, v in expected_sent(dp, args.grad_accum).items()}
    mem = {k: int(common.mpi_reduce(comm, v)) for k, v in mem.items()}
    mem["activations_peak"] = int(common.mpi_reduce(comm, MEMORY.peak_bytes))
    split = {k: int(v) for k, v in split.items()}   # this rank's: the table shows rank 0's peak and its parts
    peak = int(common.mpi_reduce(comm, sum(split.values()) if stage == 0 else dp.peak_grad_bytes))
    root = dp.groups[0].n if stage == 3 else 0
    blocks = max(g.n for g in dp.groups[1:]) if stage == 3 and len(dp.groups) > 1 else 0
    if stage == 2 and overlap:                      # the largest bucket, for the in-flight bound
        blocks = dp.max_in_flight * max(g.n for g in dp.groups)
    name = f"{stage}" + ((" overlap" if overlap else " naive") if stage == 2 else "")
    return dict(stage=stage, name=name, grad_peak=peak, grad_split=split,
                grad_peak_formula=peak_grad_formula(stage, overlap, psi, world, item, args.grad_accum, root, blocks,
                                                    split["full"]), rel=float(common.mpi_reduce(comm, rel)), abs=float(common.mpi_reduce(comm, abs_diff)),
                losses=list(state["loss"]), mem=mem, formula=engine_state_bytes(stage, psi, world, item),
                sent=sent, exact=exact, paper=zero_bytes(stage, psi, world, item, args.grad_accum, root),
                psi=psi, root=root, moved=moved, time=float(common.mpi_reduce(comm, float(np.median(times)))))


def peak_grad_formula(stage, overlap, psi, n, item, k, root, block, filling=0):
    """Gradient bytes alive at the peak of a step, by the stage's rule
    (plan.memory.zero_grad_peak_bytes), and the rule in words: (bytes, words)."""
    peak = zero_grad_peak_bytes(stage, psi, n, item, k, overlap, root, block, filling)
    if stage == 0:
        return peak, "Psi: every rank holds the whole gradient"
    if stage == 1:
        return peak, "Psi + Psi/N: the local gradient and my reduced partition"
    if stage == 2 and not overlap:
        return peak, ("Psi" + (" + Psi/N" if k > 1 else "")
                      + ": the whole gradient waits for backward's end" + (", beside my partition" if k > 1 else ""))
    if stage == 2:
        bound = zero_grad_peak_bytes(stage, psi, n, item, k, overlap, root, block)
        return peak, f"at most Psi/N + 2 buckets {fmt_bytes(bound)} + filling {fmt_bytes(filling)} (measured)"
    return peak, "at most Psi/N + root + one block (the root's wte waits for backward's end)"


def main(args):
    comm = harness.comm_world()
    rank, world = comm.Get_rank(), comm.Get_size()
    cfg = common.config_from_args(args, world)
    rows = common.batch_rows(args, rank, world)
    data = common.load_dataset(args, comm)
    stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    # stage 2 both ways (the difference is the lesson), unless --overlap asks for the one
    runs = [(s, o) for s in stages for o in ((True,) if s == 2 and args.overlap else (False, True) if s == 2 else (False,))]
    say(f"Lesson 05: ZeRO stage {args.stage} on {world} ranks"
        + (" (stage 2 overlapped with backward)" if args.overlap else "") + "\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} {cfg.dtype}; global batch "
        f"{args.batch_size} = {world} ranks x {args.batch_size // world}"
        + (f" as {args.grad_accum} micro-batches" if args.grad_accum > 1 else ""))
    ref_model, ref_opt, tc = make_run(args, cfg)
    ref = common.train_and_collect(ref_model, ref_opt, data, args, tc, micro=args.grad_accum)
    tol = harness.TOLERANCE[cfg.dtype]
    say("\nwhat was compared, one process against each stage:")
    for line in common.COMPARED:
        say(f"  - {line}")
    say("  sharded stages: each rank's partition \"NAME[a:b]\" against elements a:b of the reference's NAME\n")
    rows_out = []
    for s, o in runs:
        t0 = time.perf_counter()
        rows_out.append(run_stage(s, o, args, cfg, data, rows, comm, ref))
        rows_out[-1]["wall"] = time.perf_counter() - t0
    item = np.dtype(cfg.dtype).itemsize
    psi = rows_out[0]["psi"]
    say(f"Psi = {psi:,} parameters x {item} B; memory per rank (the largest over ranks), measured,\n"
        "and under it the formula")
    header = ["stage", "max_rel_diff", "params", "grads", "optimizer", "activations", "step"]
    table = []
    for r in rows_out:      # two rows a stage (measured, formula): side by side they are too wide
        table.append([r["name"], f"{r['rel']:.1e}", *(fmt_bytes(r["mem"][k]) for k in ("params", "grads", "optimizer")),
                      fmt_bytes(r["mem"]["activations_peak"]), f"{r['time'] * 1e3:.0f} ms"])
        table.append(["  formula", "", *(fmt_bytes(r["formula"][k]) for k in ("params", "grads", "optimizer")), "", ""])
    harness.table(table, header=header)
    say("  formula: params Psi (stage 3: Psi/N), grads Psi (stage 1: the local Psi + my reduced Psi/N;\n"
        "  2, 3: Psi/N), optimizer 2 Psi values of AdamW's m and v (stages 1-3: Psi/N); x bytes per value")
    say("\ngradient memory at its peak during a step on rank 0, measured from the arrays:\n"
        "the peak and what made it")
    harness.table([[r["name"], fmt_bytes(sum(r["grad_split"].values())), fmt_bytes(r["grad_split"]["full"]),
                     fmt_bytes(r["grad_split"]["partitions"]), fmt_bytes(r["grad_split"]["in_flight"])]
                   for r in rows_out],
                  header=["stage", "peak", "full-size .grad", "my partitions", "buckets in flight"])
    say(f"\n  {'stage':<9}  {'formula':>10}\n  {'-' * 9}  {'-' * 10}  {'-' * 40}")
    for r in rows_out:
        say(textwrap.fill(f"  {r['name']:<9}  {fmt_bytes(r['grad_peak_formula'][0]):>10}  {r['grad_peak_formula'][1]}",
                          harness.WIDTH, subsequent_indent=" " * 25, break_long_words=False))
    over = [r for r in rows_out if r["name"] == "2 overlap"]
    naive = [r for r in rows_out if r["name"] == "2 naive"]
    if over and naive:
        say(f"  stage 2 overlapped peaks at {over[0]['grad_peak'] / naive[0]['grad_peak']:.0%} of the naive version "
            "(largest over ranks):\n  a bucket's full-size gradient goes once its reduce-scatter is done, two at most "
            "fly at once;\n  wte's gradient, tied to the head, fills all through backward\n  (the bound's filling "
            "term: the full-size .grad of buckets still filling at the peak)")
    k = args.grad_accum
    labels = {0: "2 Psi", 1: "2 Psi", 2: f"{k} Psi + Psi" if k > 1 else "2 Psi", 3: f"{k} x (3 Psi - root)" if k > 1 else "3 Psi - root"}
    say("\ncommunication per step per rank, bytes sent:\n  measured | ring's exact count | paper's (N-1)/N x what is sent,"
        " and by collective")
    for r in rows_out:
        got, exact = sum(r["sent"].values()), sum(r["exact"].values())
        say(f"  stage {r['name']:<9} {got:>10,} | {exact:>10,} | {r['paper']:>12,.0f} ({labels[r['stage']]})"
            + ("" if got == exact else "  DIFFERS") + f"\n  {'':<16}"
            + ", ".join(f"{c} {v:,}" for c, v in r["sent"].items()))
    say("  stages 0, 1: the gradient is reduced once per step (2 Psi); stages 1-3 all-gather Psi of weights"
        + (f";\n  with {k} micro-batches stage 2 reduce-scatters each one ({k} Psi: it keeps no full gradient to add\n"
           f"  into), stage 3 gathers and reduces per micro-batch" if k > 1 else ""))
    if 3 in stages:
        root = rows_out[-1]["root"]
        say(f"  stage 3: gather for forward, again for backward, reduce-scatter: 3 Psi, less the root unit\n  ({root:,} "
            "parameters: embeddings, ln_f), which stays gathered from forward to backward because the\n  head tied "
            "to wte is backward's first op")
    if backend.DEVICE != "cpu":        # nothing crosses on the CPU: said on a device only
        staged = {0: "2 Psi (all-reduce: M down, M up)", 1: "2 Psi + 2 Psi/N (M down + M/N up, or back)",
                  3: "(3 Psi - root)(1 + 1/N)"}
        how = ("MPI reads device memory\n(CUDA-aware): only token ids in and the loss out" if staging.DIRECT else
               "each collective staged through the\nhost, plus token ids in and the loss out")
        say(f"\nhost<->device bytes per step on this rank, by stage: {how} (Psi bytes: Psi x itemsize)")
        for r in rows_out:
            plain = args.grad_accum == 1 and not staging.DIRECT     # the rules hold for one micro-batch
            rule = staged[min(r["stage"], 1) if r["stage"] < 3 else 3] if plain else ""
            say(f"  stage {r['name']:<9} {r['moved']:>10,.0f} = {r['moved'] / (r['psi'] * item):.2f} x Psi bytes  "
                f"{rule}".rstrip())
    rel = max(r["rel"] for r in rows_out)
    match = bool(rel <= tol and all(sum(r["sent"].values()) == sum(r["exact"].values()) for r in rows_out))
    say(f"\nlosses: reference {', '.join(f'{v:.6f}' for v in ref[0])}; tolerance {tol:.0e} per tensor")
    last = rows_out[-1]
    figures = {}
    for r in rows_out:
        key = "stage" + r["name"].replace(" ", "_")
        for k in ("params", "grads", "optimizer"):
            figures[f"{key}_{k}_measured"] = r["mem"][k]
            figures[f"{key}_{k}_formula"] = r["formula"][k]
        figures[f"{key}_grads_peak_measured"] = r["grad_peak"]
        figures[f"{key}_grads_peak_formula"] = r["grad_peak_formula"][0]
        figures[f"{key}_bytes_sent"] = sum(r["sent"].values())
        figures[f"{key}_bytes_paper"] = r["paper"]
        figures[f"{key}_max_rel_diff"] = r["rel"]
        figures[f"{key}_host_device_bytes_per_step"] = r["moved"]
    report = harness.new_report(
        "05_zero", args, parallel={"dp": world, "tp": 1, "pp": 1, "zero_stage": args.stage,
                                   "grad_accum": args.grad_accum, "overlap": bool(args.overlap)},
        match=match, max_rel_diff=rel, max_abs_diff=max(r["abs"] for r in rows_out), tolerance=tol,
        losses={"reference": ref[0], "parallel": last["losses"]},
        comm={"bytes_sent": last["sent"], "expected_bytes": last["exact"]}, memory=last["mem"],
        step_time_s=last["time"], figures=figures)
    return harness.finish(report, args)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=24)
    p.add_argument("--stage", choices=["1", "2", "3", "all"], default="all", help="ZeRO stage (default all)")
    p.add_argument("--overlap", action="store_true",
                   help="stage 2: only the overlapped version (buckets reduce-scattered during backward)")
    p.add_argument("--bucket-kb", type=harness.positive_int, default=64, help="stage 2 bucket size in KiB")
    common.add_step_flags(p, grad_accum=True)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
