"""Lesson 02: data parallelism. Every rank holds the whole model, trains on its own slice
of the global batch and averages gradients with a ring all-reduce; the run must equal one
process training on the whole batch.

    mpirun -n 4 python -m minidist.lessons.02_data_parallel
    mpirun -n 4 python -m minidist.lessons.02_data_parallel --naive
    mpirun -n 3 python -m minidist.lessons.02_data_parallel --grad-accum 2 --dropout 0.1
    mpirun -n 4 python -m minidist.lessons.02_data_parallel --dtype float32 --json out.json

It trains a few AdamW steps (with gradient clipping) data-parallel and single-process
from the same seed and global batch, compares the losses, the raw gradients of every
step (averaged across ranks, before clipping and AdamW, which would hide a gradient off
by a constant factor) and the weights, checks that the replicas stayed identical, prints the bytes each rank sent beside 2(N-1)/N x the
gradient bytes, then times naive against bucketed synchronisation and draws when each
bucket's all-reduce ran against the backward.
"""
import os
import time

import numpy as np
from mpi4py import MPI

from minidist import metrics
from minidist.comm import stats
from minidist.data import shard_slice
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel.data_parallel import (BucketedDataParallel, NaiveDataParallel,
                                             broadcast_parameters, replica_checksums)
from minidist.plan.traffic import dp_bytes
from minidist.tensor import MEMORY
from minidist.train import TrainConfig, micro_batches


def make_run(args, cfg):
    """A fresh model and optimizer from the seed, and the training schedule."""
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    model = GPT(cfg, seed=args.seed)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    return model, opt, tc


def make_dp(model, comm, args):
    if args.naive:
        return NaiveDataParallel(model, comm)
    return BucketedDataParallel(model, comm, bucket_bytes=int(args.bucket_mb * 2**20))


def time_sync(model, comm, args, data, naive):
    """One forward + backward + gradient sync on the first batch, `args.timing_reps` times.

    Returns medians of (backward seconds, seconds from the end of backward until the
    gradients are averaged) and the bucketed version's last timeline.
    """
    args_mode = type(args)(**{**vars(args), "naive": naive})
    dp = make_dp(model, comm, args_mode)
    rows = shard_slice(args.batch_size, comm.Get_rank(), comm.Get_size())
    x, y = data.get_batch("train", args.batch_size, 0)
    (xb, yb, rng), = micro_batches(x[rows], y[rows], 0, args.seed, 1, first_sample=rows.start)
    back, after = [], []
    for _ in range(args.timing_reps):
        model.zero_grad()
        _, loss = model(xb, yb, rng=rng)
        comm.Barrier()  # start together, so one rank's wait is not counted as communication
        t0 = time.perf_counter()
        with dp.backward_context(last=True):
            loss.backward()
        t1 = time.perf_counter()
        dp.sync()
        t2 = time.perf_counter()
        back.append(t1 - t0)
        after.append(t2 - t1)
    return float(np.median(back)), float(np.median(after)), getattr(dp, "timeline", None)


def draw_timeline(tl, width=52):
    """The bucketed step as text: backward, then one row per bucket's all-reduce."""
    t0, t_end = tl["backward_start"], tl["sync_end"]
    span = max(t_end - t0, 1e-9)

    def bar(a, b, ch):
        i, j = int((a - t0) / span * width), max(int((b - t0) / span * width), int((a - t0) / span * width) + 1)
        return " " * i + ch * (j - i) + " " * (width - j)

    ms = lambda t: (t - t0) * 1e3
    say(f"  {'backward':<22}|{bar(t0, tl['backward_end'], '#')}| {0:6.1f} - {ms(tl['backward_end']):6.1f} ms")
    for idx, nbytes, nparams, a, b in tl["buckets"]:
        label = f"bucket {idx} ({fmt_bytes(nbytes)})"
        say(f"  {label:<22}|{bar(a, b, '=')}| {ms(a):6.1f} - {ms(b):6.1f} ms")
    say(f"  {'':<22} {'^ backward ends':>{int((tl['backward_end'] - t0) / span * width) + 15}}")


def main(args):
    comm = harness.comm_world()
    rank, world = comm.Get_rank(), comm.Get_size()
    cfg = common.config_from_args(args, world)
    harness.need(args.lr > 0, f"--lr must be positive, got {args.lr}")
    harness.need(args.bucket_mb > 0, f"--bucket-mb must be positive, got {args.bucket_mb}")
    rows = common.batch_rows(args, rank, world)
    data = common.load_dataset(args, comm)
    mode = "naive (one ring all-reduce per parameter)" if args.naive else f"bucketed ({args.bucket_mb:g} MiB buckets, overlapped)"
    say(f"Lesson 02: data parallelism on {harness.ranks(world)}, {mode}\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"dropout={cfg.dropout} {cfg.dtype}")
    per_rank = args.batch_size // world
    say(f"batch   global {args.batch_size} sequences = {harness.ranks(world)} x {per_rank}"
        + (f" (each as {args.grad_accum} micro-batches of {per_rank // args.grad_accum}, one all-reduce per step)"
           if args.grad_accum > 1 else ""))
    say(f"steps   {args.steps} AdamW steps, " + (f"gradient clipping at norm {args.grad_clip}" if args.grad_clip
                                                  else "no gradient clipping"))

    # --- the data-parallel run: same seed on every rank, then rank 0's weights broadcast
    model, opt, tc = make_run(args, cfg)
    broadcast_parameters(model, comm, root=0)
    dp = make_dp(model, comm, args)
    MEMORY.reset_peak()
    with stats.measure() as m:
        losses, state, times = common.train_and_collect(model, opt, data, args, tc, rows, args.grad_accum, dp)
    # a step's loss is the mean over the global batch: average the ranks' means (MPI's own)
    losses = list(common.mpi_reduce(comm, losses, "sum") / world)
    sent = int(common.mpi_reduce(comm, m.bytes_sent("all_reduce") // args.steps))
    msgs = int(common.mpi_reduce(comm, m.messages("all_reduce") // args.steps))
    grad_bytes = sum(p.data.nbytes for p in model.parameters())
    expected = int(dp_bytes(grad_bytes, world, 1))          # 2(N-1)/N of M bytes, whole bytes
    crcs = replica_checksums(model, comm)
    mem = harness_memory(model, opt, dp, comm)

    # --- the reference: one process, the whole global batch, no communication
    ref_model, ref_opt, _ = make_run(args, cfg)
    ref_losses, ref_state, _ = common.train_and_collect(ref_model, ref_opt, data, args, tc)
    state["loss"], ref_state["loss"] = np.array(losses), np.array(ref_losses)
    rel, abs_diff, _ = harness.compare(state, ref_state)
    rel, abs_diff = common.mpi_reduce(comm, [rel, abs_diff])  # every rank compares its own replica
    tol = harness.TOLERANCE[cfg.dtype]
    identical = len(set(crcs.tolist())) == 1
    match = bool(rel <= tol and identical)

    common.report_comparison(comm, harness.ranks(world), ref_losses, losses, state, ref_state, tol,
                             show_where=" on rank 0")
    say(f"  tolerance {tol:.0e} ({cfg.dtype}) per tensor: {'all within' if rel <= tol else 'OUTSIDE'}")
    factor, residual = common.gradient_factor(state, ref_state)
    if rel > tol and factor is not None and residual < 1e-3 and abs(factor - 1) > tol:
        say(f"  on rank 0, step 0's raw gradients are {factor:.6g} x the reference's everywhere (residual "
            f"{residual:.1e}):\n  a constant factor. Look at how the gradients are averaged (/ N) and how "
            f"micro-batch losses are scaled (/ k)")
    say(f"  replicas after training: {'identical' if identical else 'DIFFERENT'} on all {harness.ranks(world)} "
        f"(CRC of the weights {crcs[0] & 0xffffffff:08x}{'' if identical else ' ...'})\n")

    say(f"communication per step, per rank (gradients: {fmt_bytes(grad_bytes)} = {grad_bytes // cfg_itemsize(cfg):,} "
        f"values x {cfg_itemsize(cfg)} B)")
    say(f"  measured  {sent:>12,} B sent in {msgs} messages (the most of any rank)")
    say(f"  formula   {expected:>12,} B = 2(N-1)/N x {grad_bytes:,} B" + ("  equal" if sent == expected else
        f"\n  ({sent - expected:+,} B: ring chunks differ by up to one element when a length does not divide by N)"))

    t_naive = time_sync(model, comm, args, data, naive=True)
    t_bucket = time_sync(model, comm, args, data, naive=False)
    slowest = [common.mpi_reduce(comm, t[0]) for t in (t_naive, t_bucket)]
    hidden = 1 - t_bucket[1] / t_naive[1] if t_naive[1] > 0 else 0.0
    say(f"\ntime of one backward + gradient averaging on rank 0 (median of {args.timing_reps})")
    harness.table([
        ["naive", f"{t_naive[0] * 1e3:.1f} ms", f"{slowest[0] * 1e3:.1f} ms", f"{t_naive[1] * 1e3:.1f} ms"],
        ["bucketed", f"{t_bucket[0] * 1e3:.1f} ms", f"{slowest[1] * 1e3:.1f} ms", f"{t_bucket[1] * 1e3:.1f} ms"],
    ], header=["sync", "backward, rank 0", "slowest rank", "wait after backward"])
    say(f"  the wait: naive, all of the communication; bucketed, what is exposed:\n"
        f"  overlap hid {hidden:.0%} of the naive wait")
    say("  The wait includes any wait for the slowest rank's backward. With more ranks than cores, ranks")
    say("  take turns on the CPU and every message also waits for its partner to be scheduled: compare")
    say(f"  -n 2 on a 2-core machine, one core per rank (this machine has {os.cpu_count()} cores).")
    if t_bucket[2] and world > 1:
        say("\nthe bucketed step on rank 0: buckets fill in reverse parameter order and start while backward runs")
        draw_timeline(t_bucket[2])

    step_time = common.mpi_reduce(comm, float(np.median(times)))   # the slowest rank's median
    tokens = args.batch_size * cfg.block_size
    fpt = metrics.flops_per_token(cfg, model.get_num_params())
    comm.Barrier()  # every rank measures its matmul rate at the same time: the job's peak
    peak = (args.peak_tflops * 1e12 * world if args.peak_tflops
            else common.mpi_reduce(comm, metrics.measure_peak_flops(cfg.dtype), "sum"))
    mfu = metrics.mfu(tokens / step_time, fpt, peak)
    say(f"\ntraining step (forward, backward, sync, AdamW): median {step_time * 1e3:.1f} ms, "
        f"{tokens / step_time:,.0f} tokens/s over the job")
    say(f"  MFU {mfu:.1%} = tokens/s x {fpt / 1e6:.2f} MFLOP/token (6N + 12LHQT) / {peak / 1e9:.1f} GFLOP/s,\n"
        f"  the job's peak ({'given' if args.peak_tflops else 'measured on all ranks at once'})")

    say("\nmemory per rank (every rank holds all of it: the baseline ZeRO will cut)")
    harness.table([[k, fmt_bytes(v)] for k, v in mem.items()], header=["category", "measured"])

    report = harness.new_report(
        "02_data_parallel", args, parallel={"dp": world, "tp": 1, "pp": 1, "grad_accum": args.grad_accum,
                                            "naive": bool(args.naive), "bucket_mb": None if args.naive else args.bucket_mb},
        match=match, max_rel_diff=rel, max_abs_diff=abs_diff, tolerance=tol,
        losses={"reference": ref_losses, "parallel": losses},
        comm={"bytes_sent": {"all_reduce": sent}, "expected_bytes": {"all_reduce": expected}},
        memory=mem, step_time_s=step_time, mfu=mfu)
    return harness.finish(report, args)


def cfg_itemsize(cfg):
    return np.dtype(cfg.dtype).itemsize


def harness_memory(model, opt, dp, comm):
    """Bytes per category on this rank (the largest over ranks), bucket buffers apart."""
    mem = metrics.memory_by_category(model.parameters(), opt, MEMORY.peak_bytes)
    mem["comm_buffers"] = sum(b.nbytes for b in getattr(dp, "buckets", []))
    return {k: int(common.mpi_reduce(comm, v or 0)) for k, v in mem.items()}


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=24)
    p.add_argument("--naive", action="store_true", help="all-reduce each gradient after backward (no buckets)")
    p.add_argument("--bucket-mb", type=harness.positive_float, default=0.25,
                   help="bucket size in MiB (default %(default)s; PyTorch DDP uses 25 for big models)")
    common.add_step_flags(p, grad_accum=True)
    p.add_argument("--timing-reps", type=harness.positive_int, default=5, help="repeats of the timing comparison")
    p.add_argument("--peak-tflops", type=harness.positive_float, help="peak TFLOP/s per rank for MFU instead of measuring it")
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
