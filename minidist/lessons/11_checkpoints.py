"""Lesson 11: checkpoints that survive a kill, resume bit for bit and move between layouts.
A run trains under one layout and saves every few steps (each rank writes what it holds,
one index says where every piece of every global tensor lives); a save is killed half
way; the run resumes from the last good checkpoint under ANOTHER layout and must go on
with the losses and weights of the run that was never interrupted.

    mpirun -n 4 python -m minidist.lessons.11_checkpoints
    mpirun -n 4 python -m minidist.lessons.11_checkpoints --save-layout zero3 --resume-layout tp2pp2
    mpirun -n 3 python -m minidist.lessons.11_checkpoints --save-layout zero2 --resume-layout dp
    mpirun -n 4 python -m minidist.lessons.11_checkpoints --dir ckpts --keep 2 --json out.json
    mpirun -n 4 python -m minidist.lessons.11_checkpoints --resume ckpts     # go on from a saved run

Compared, in float64: the losses of every step and the final weights of (the first part
under the saving layout, then the rest resumed under the other layout) against one
process trained without a stop. Printed: what each save wrote (files, which rank wrote
which pieces, bytes per rank, time), what the killed save left behind and that the
previous checkpoint still verifies, the load's time, and the verdict. The checkpoints
stay in --dir (a temporary folder by default, removed at the end).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from minidist.checkpoint import layouts, store
from minidist.checkpoint.format import CheckpointError
from minidist.lessons import common, harness
from minidist.lessons import layout_runs as runs
from minidist.lessons.harness import fmt_bytes, say


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=6)
    common.add_model_flags(p, n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=8)
    p.add_argument("--lr", type=harness.positive_float, default=3e-3, help="learning rate (default %(default)s)")
    p.add_argument("--grad-clip", type=harness.nonnegative_float, default=0.5, help="clip the global norm (0: off)")
    p.add_argument("--save-layout", default="zero3", help=f"the layout that trains first and saves ({', '.join(runs.LAYOUTS)})")
    p.add_argument("--resume-layout", default=None,
                   help="the layout that resumes (default: tp2pp2 on 4 ranks, dp otherwise)")
    p.add_argument("--save-every", type=harness.positive_int, default=1, help="steps between saves (default 1)")
    p.add_argument("--stop-at", type=harness.positive_int, default=None,
                   help="the step the first part stops at (default: half of --steps)")
    p.add_argument("--keep", type=harness.positive_int, default=2, help="checkpoints kept (default 2)")
    p.add_argument("--dir", metavar="PATH", help="where the checkpoints go (kept); default a temporary folder")
    p.add_argument("--resume", metavar="CKPT", help="skip the first part: resume from this checkpoint (or folder)")
    p.add_argument("--no-kill", dest="kill", action="store_false", help="do not demonstrate the killed save")
    p.add_argument("--offload", choices=["none", "disk", "host"], default="none",
                   help="disk: the ZeRO layouts keep AdamW's state (stage 3: the shards too) in files "
                        "(ZeRO-Infinity's NVMe tier); prints resident memory with and without")
    return p


def shared_text(comm, text):
    """Rank 0's string on every rank (two buffer broadcasts)."""
    raw = np.frombuffer(text.encode(), np.uint8) if comm.Get_rank() == 0 else None
    n = np.array([0 if raw is None else raw.size], np.int64)
    comm.Bcast(n, root=0)
    buf = raw.copy() if comm.Get_rank() == 0 else np.empty(int(n[0]), np.uint8)
    comm.Bcast(buf, root=0)
    return buf.tobytes().decode()


def check_input(args, cfg, world):
    args.resume_layout = args.resume_layout or ("tp2pp2" if world == 4 else "dp")
    args.stop_at = args.stop_at or max(1, args.steps // 2)
    harness.need(args.stop_at < args.steps, f"--stop-at {args.stop_at} must be before the last step (--steps {args.steps})")
    for flag, name in (("--save-layout", args.save_layout), ("--resume-layout", args.resume_layout)):
        why = runs.problem(name, world, cfg)
        harness.need(why is None, f"{flag} {name}: {why}")
    if args.offload == "host":
        from minidist.backend import xp
        from minidist.parallel.offload import HOST_IS_DEVICE
        harness.need(xp.__name__ != "numpy", "--offload host: " + HOST_IS_DEVICE.split(": ", 1)[1])
    harness.need(args.offload == "none" or any(n.startswith("zero") for n in (args.save_layout, args.resume_layout)),
                 "--offload disk moves ZeRO's partitions: give --save-layout or --resume-layout zero1, zero2 or zero3")
    if not any(n in ("tp", "pp", "tp2pp2") for n in (args.save_layout, args.resume_layout)):
        common.batch_rows(args, 0, world)           # the batch splits over the ranks


def offload_kw(args, root, part):
    """ZeRO's offload options for one part of the run (each its own folder of files)."""
    if args.offload == "none":
        return {}
    return {"offload": "disk", "offload_dir": os.path.join(root, f"offload-{part}")}


def offload_report(comm, args, cfg, data, root):
    """Resident memory that one ZeRO step of the same layout adds, offloaded and in memory."""
    import gc
    from minidist.parallel.offload import rss_bytes
    name = args.resume_layout if args.resume_layout.startswith("zero") else args.save_layout
    out = {}
    for kind in ("disk", "none"):
        kw = {} if kind == "none" else {"offload": "disk", "offload_dir": os.path.join(root, "offload-measure")}
        gc.collect()
        before = rss_bytes()
        run = runs.build(name, comm, cfg, args.seed, args.lr, **kw)
        t0 = time.perf_counter()
        runs.train(run, data, args.batch_size, 0, 1, args.lr, args.grad_clip, args.seed)
        seconds = common.mpi_reduce(comm, time.perf_counter() - t0)
        grew = common.mpi_reduce(comm, float(rss_bytes() - before))
        moved = run.zero.offload_bytes()
        held = sum(a.nbytes for s in run.zero.inner.state.values() for a in s.values() if hasattr(a, "nbytes"))
        shards = sum(g.shard.nbytes for g in run.zero.groups) if run.zero.stage == 3 else 0
        out[kind] = (grew, moved, held + shards, shards, seconds)
        run.zero.close()
        del run
    (grew1, moved, state, shards, t1), (grew0, t0) = out["disk"], (out["none"][0], out["none"][4])
    steps = max(1, moved["steps"])
    say(f"\noffload to disk ({name}): AdamW's m and v of each rank's partition"
        + (" and its shards" if name == "zero3" else "") + " live in files, stepped in chunks")
    say(f"  resident memory one step of {name} added, largest rank: in memory {fmt_bytes(grew0)}, "
        f"offloaded {fmt_bytes(grew1)}\n  (difference {fmt_bytes(grew0 - grew1)}, beside the {fmt_bytes(state)} per rank "
        f"kept in files; glibc keeps freed\n  memory unless MALLOC_MMAP_THRESHOLD_=131072: small models blur it)")
    say(f"  per step and rank: read {fmt_bytes(moved['bytes_read'] / steps)}, written "
        f"{fmt_bytes((moved['bytes_written'] - shards) / steps)}"
        + (f" (+ the shards, {fmt_bytes(shards)}, once at the start)" if shards else ""))
    say(f"  the step's time, slowest rank: {t0 * 1e3:.1f} ms in memory, {t1 * 1e3:.1f} ms offloaded "
        f"(one step each: compare, do not quote)")
    return {"rss_added_in_memory": grew0, "rss_added_offloaded": grew1, "state_bytes": state,
            "step_s_in_memory": t0, "step_s_offloaded": t1, **moved}


def run_meta(args, step):
    """What a resumed run needs besides the tensors. The batches, the learning rate and the
    dropout masks are functions of (seed, step, sample) here, so the step is the data
    position, the schedule's position and the RNG state at once: nothing else to store."""
    return {"seed": args.seed, "batch_size": args.batch_size, "data": {"position": step, "split": "train"},
            "lr": {"schedule": "constant", "value": args.lr}, "rng": "dropout from (seed, step, sample)"}


def describe_save(path, comm):
    """Lines about one checkpoint: its files, bytes per rank, pieces per rank."""
    index = store.load_index(path)
    per_rank = {}
    for name, t in index["tensors"].items():
        for piece in t["pieces"]:
            per_rank.setdefault(piece["file"], []).append(name)
    lines = []
    for fname in sorted(index["files"]):
        names = per_rank.get(fname, [])
        kinds = [k for k, pre in (("weights", "model."), ("m", "optim.exp_avg."), ("v", "optim.exp_avg_sq."),
                                  ("step", "optim.step")) if any(n.startswith(pre) for n in names)]
        lines.append(f"    {fname}  {fmt_bytes(index['files'][fname]['size']):>11}  {len(names):3d} pieces  "
                     f"({', '.join(kinds) or 'nothing'})")
    from minidist.checkpoint.format import read_header
    tensors = index["tensors"]
    headers = [read_header(os.path.join(path, fname)) for fname in sorted(index["files"])]
    data = sum(h.file_size - h.data_start for h in headers)      # measured: the files' data sections
    psi = sum(int(np.prod(t["shape"], dtype=np.int64)) for n, t in tensors.items() if n.startswith("model."))
    item = np.dtype(tensors[next(n for n in tensors if n.startswith("model."))]["dtype"]).itemsize
    files = sum(f["size"] for f in index["files"].values())
    lines.append(f"  all files {fmt_bytes(files)}, of which data {data:,} B (after each header); by formula, weights, m\n"
                 f"  and v, 3 x {psi:,} parameters x {item} B, + 8 B (the step) = {3 * psi * item + 8:,} B")
    return lines


def killed_save(root, latest_before):
    """A save killed by SIGKILL after its index is written, before it is published: run in a
    child process (one process that loads the latest checkpoint and saves it again)."""
    code = ("import os,sys; os.environ['MINIDIST_CKPT_KILL_AT']='after-index'\n"
            "from minidist.checkpoint import store\n"
            "ck = store.resolve(sys.argv[1]); ix = store.load_index(ck)\n"
            "pieces = [{'name': n, 'global_shape': tuple(t['shape']), 'dtype': t['dtype'], 'box': [[0, s] for s in t['shape']],"
            " 'array': store.read_global(ck, ix, n)} for n, t in ix['tensors'].items()]\n"
            "store.save(None, sys.argv[1], ix['step'] + 1000, pieces, ix['meta'])\n")
    env = dict(os.environ)
    for k in list(env):                  # the child is one plain process, not a rank of this job
        if k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_")):
            del env[k]
    proc = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, env=env, timeout=120)
    left = sorted(f for f in os.listdir(root) if f.startswith(".tmp-"))
    after = store.resolve(root)
    problems = store.verify(root)
    return proc.returncode, left, after, problems


def main(args):
    comm = harness.comm_world()
    rank, world = comm.Get_rank(), comm.Get_size()
    args.grad_accum = 1
    cfg = common.config_from_args(args, world)
    check_input(args, cfg, world)
    data = common.load_dataset(args, comm)
    root = shared_text(comm, os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="minidist-l11-")
                       if rank == 0 else "")
    if args.dir and rank == 0:
        os.makedirs(root, exist_ok=True)
    say(f"Lesson 11: checkpoints on {harness.ranks(world)}: save under {args.save_layout}, "
        f"resume under {args.resume_layout}\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} {cfg.dtype}, global batch "
        f"{args.batch_size}, {args.steps} AdamW steps\ncheckpoints in {root}")

    # the run that is never interrupted: one process on every rank (a small model)
    from mpi4py import MPI
    ref = runs.build("single", MPI.COMM_SELF, cfg, args.seed, args.lr)
    ref_losses = runs.train(ref, data, args.batch_size, 0, args.steps, args.lr, args.grad_clip, args.seed)

    first, save_lines, killed = [], [], None
    try:
        if args.resume:
            path = os.path.abspath(args.resume)
        else:
            run = runs.build(args.save_layout, comm, cfg, args.seed, args.lr, **offload_kw(args, root, "part1"))
            say(f"\npart 1: {run.describe()}, steps 0-{args.stop_at - 1}, a save every {args.save_every}")
            for start in range(0, args.stop_at, args.save_every):
                stop = min(args.stop_at, start + args.save_every)
                first += runs.train(run, data, args.batch_size, start, stop, args.lr, args.grad_clip, args.seed)
                t0 = time.perf_counter()
                path = layouts.save(comm, root, stop, run.model, run.opt, run.zero, meta=run_meta(args, stop),
                                    keep=args.keep)
                save_lines.append((stop, time.perf_counter() - t0))
            say(f"  saved at steps {', '.join(str(s) for s, _ in save_lines)}; kept {args.keep}: "
                f"{', '.join(sorted(f for f in os.listdir(root) if f.startswith('step')))}")
            say(f"  the last save, {os.path.basename(path)}: {save_lines[-1][1] * 1e3:.1f} ms; one file per rank:")
            for line in describe_save(path, comm):
                say(line)
            say(f"  every piece, and which rank wrote it:\n    python -m minidist.checkpoint show {path}")
            if args.kill and rank == 0:
                killed = killed_save(root, path)
            comm.Barrier()
        # part 2: resume under the other layout
        resumed = runs.build(args.resume_layout, comm, cfg, args.seed + 1, args.lr,   # other weights: all replaced
                             **offload_kw(args, root, "part2"))
        t0 = time.perf_counter()
        meta = layouts.load(comm, path, resumed.model, resumed.opt, resumed.zero)
    except CheckpointError as e:
        raise harness.InputError(str(e))
    load_s = time.perf_counter() - t0
    start = int(meta["train_step"])
    for key, mine in (("seed", args.seed), ("batch_size", args.batch_size)):
        harness.need(meta.get(key, mine) == mine, f"the checkpoint was trained with --{key.replace('_', '-')} "
                     f"{meta.get(key)}, this run has {mine}: resume with the same value")
    harness.need(start < args.steps, f"the checkpoint is at step {start}: nothing left to train (--steps {args.steps})")
    if killed is not None:
        code, left, after, problems = killed
        say(f"\na save killed with SIGKILL after writing its files and index, before publishing (exit {code}):")
        say(f"  left behind: {', '.join(left) or 'nothing'} (ignored, removed by the next save)")
        say(f"  latest still names {os.path.basename(after)}; verify: {'ok' if not problems else problems[0]}")
    say(f"\npart 2: {resumed.describe()}, steps {start}-{args.steps - 1}\n"
        f"  loaded {os.path.basename(store.resolve(path))} (saved by {meta['layout']['kind']} on "
        f"{harness.ranks(meta['layout']['ranks'])}) in {load_s * 1e3:.1f} ms")
    rest = runs.train(resumed, data, args.batch_size, start, args.steps, args.lr, args.grad_clip, args.seed)
    final = layouts.save(comm, root, args.steps, resumed.model, resumed.opt, resumed.zero, keep=args.keep)
    got = {n: store.read_global(final, store.load_index(final), f"model.{n}") for n, _ in ref.model.named_parameters()}

    offload = offload_report(comm, args, cfg, data, root) if args.offload == "disk" else None
    for r in (locals().get("run"), resumed):
        if r is not None and r.zero is not None:
            r.zero.close()
    losses = first + rest
    have = ref_losses[:len(first)] + ref_losses[start:]
    state = {"loss": np.array(losses), **{f"weight:{n}": got[n] for n in got}}
    want = {"loss": np.array(have), **{f"weight:{n}": p.data for n, p in ref.model.named_parameters()}}
    rel, abs_diff, worst = harness.compare(state, want)
    tol = harness.TOLERANCE[cfg.dtype]
    say("\nwhat was compared, one process without a stop against the run saved, killed and resumed:")
    harness.table([[s, f"{a:.6f}", f"{b:.6f}", "part 1" if s < len(first) else "part 2"]
                   for s, (a, b) in enumerate(zip(have, losses), start=0 if not args.resume else start)],
                  header=["step", "uninterrupted", "resumed run", ""])
    say(f"  losses and final weights: max_rel_diff {rel:.1e}\n  (largest in {common.where(worst)})")
    report = harness.new_report("11_checkpoints", args, parallel={"save": args.save_layout, "resume": args.resume_layout},
                                match=bool(rel <= tol), max_rel_diff=rel, max_abs_diff=abs_diff, tolerance=tol,
                                losses={"uninterrupted": have, "resumed": losses},
                                figures={"save_ms": [t * 1e3 for _, t in save_lines], "load_ms": load_s * 1e3,
                                         "resumed_from_step": start, "offload": offload,
                                         "killed_save_left_latest_intact": None if killed is None else
                                         bool(not killed[3] and killed[2] == store.resolve(path))})
    if not args.dir and rank == 0:
        comm.Barrier()
        shutil.rmtree(root, ignore_errors=True)
    elif not args.dir:
        comm.Barrier()
    return harness.finish(report, args)


if __name__ == "__main__":
    harness.run(main, build_parser())
