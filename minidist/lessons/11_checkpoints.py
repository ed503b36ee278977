"""Lesson 11: checkpoints that survive a kill, resume bit for bit and move between layouts.
A run trains under one layout and saves every few steps (each rank writes what it holds,
one index says where every piece of every global tensor lives); a save is killed half
way; the run resumes from the last good checkpoint under ANOTHER layout and must go on
with the losses and weights of the run that was never interrupted.

Over 400 lines but one story: named steps (train and save, the killed save, the resume under
another layout, the reads, offload's report), each a function; saving and loading live in
minidist/checkpoint/.

    mpirun -n 4 python -m minidist.lessons.11_checkpoints
    mpirun -n 4 python -m minidist.lessons.11_checkpoints --save-layout zero3 --resume-layout tp2pp2
    mpirun -n 3 python -m minidist.lessons.11_checkpoints --save-layout zero2 --resume-layout dp
    mpirun -n 4 python -m minidist.lessons.11_checkpoints --dir ckpts --keep 2 --json out.json
    mpirun -n 4 python -m minidist.lessons.11_checkpoints --resume ckpts     # go on from a saved run

Compared, in float64: the losses of every step and the final weights of (the first part
under the saving layout, then the rest resumed under the other layout) against one
process trained without a stop. Printed: what each save wrote (files, which rank wrote
which pieces, bytes per rank, time), what the killed save left behind and that the
previous checkpoint still verifies, the load's time and the bytes it needed beside the
bytes it read, and the verdict (after a MISMATCH, whether it looks like drift or a
resume bug). With --offload disk: memory, bytes moved and the optimizer step's time with
and without prefetching the next chunk. On a device (MINIDIST_DEVICE=strict or cuda): the
host<->device bytes per step of each part, the bytes the last save brought home and the
load sent (each piece crosses once, explicitly). The checkpoints stay in --dir (by default a
temporary folder, removed however the run ends, SIGKILL aside).
"""
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from minidist import equivalence, transfers
from minidist.backend import DEVICE
from minidist.checkpoint import layouts, read as reader, store
from minidist.checkpoint.index import load_index, resolve
from minidist.checkpoint.format import CheckpointError
from minidist.lessons import common, harness
from minidist.lessons import layout_runs as runs
from minidist.lessons.harness import fmt_bytes, say
from minidist.plan.memory import checkpoint_data_bytes


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
        from minidist.parallel.offload import HOST_IS_DEVICE
        harness.need(DEVICE != "cpu", "--offload host: " + HOST_IS_DEVICE.split(": ", 1)[1])
        harness.need(False, "--offload host: pinned host memory (ZeRO-Offload's) is not implemented")
    harness.need(args.offload == "none" or any(n.startswith("zero") for n in (args.save_layout, args.resume_layout)),
                 "--offload disk moves ZeRO's partitions: give --save-layout or --resume-layout zero1, zero2 or zero3")
    if not any(n in ("tp", "pp", "tp2pp2") for n in (args.save_layout, args.resume_layout)):
        common.batch_rows(args, 0, world)           # the batch splits over the ranks


def offload_kw(args, root, part):
    """ZeRO's offload options for one part of the run (each its own folder of files)."""
    if args.offload == "none":
        return {}
    return {"offload": "disk", "offload_dir": os.path.join(root, f"offload-{part}")}


def timed_steps(comm, offloaded, prefetch, repeats=3):
    """The optimizer step alone (the gradients of the last step stay), slowest rank, best of
    `repeats`: with the reader thread (prefetch) or reading each chunk in turn."""
    offloaded.prefetch = prefetch
    best, reading = float("inf"), 0.0
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        offloaded.step()
        t = common.mpi_reduce(comm, time.perf_counter() - t0)
        if t < best:
            best, reading = t, common.mpi_reduce(comm, offloaded.read_seconds)
    offloaded.prefetch = True
    return best, reading


def offload_report(comm, args, cfg, data, root):
    """Resident memory that one ZeRO step of the same layout adds, offloaded and in memory;
    the optimizer step's time with the next chunk's read overlapped and without."""
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
        moved = dict(run.zero.offload_bytes())
        moved["read_by_kind"] = dict(moved.get("read_by_kind", {}))
        shards = sum(g.shard.nbytes for g in run.zero.groups) if run.zero.stage == 3 else 0
        files = run.zero.offload.store.file_bytes() if kind == "disk" else {}     # m, v, shards, grads
        overlap = None
        if kind == "disk":            # the step alone, in turn then overlapped, alternating
            serial = timed_steps(comm, run.zero.offload, False)
            ahead = timed_steps(comm, run.zero.offload, True)
            overlap = (min(serial, timed_steps(comm, run.zero.offload, False)),
                       min(ahead, timed_steps(comm, run.zero.offload, True)))    # (seconds, reading)
        out[kind] = (grew, moved, files, shards, seconds, overlap)
        run.zero.close()
        del run
    (grew1, moved, files, shards, t1, ((serial, reading), (ahead, _))), (grew0, t0) = \
        out["disk"], (out["none"][0], out["none"][4])
    state, kept = files["exp_avg"] + files["exp_avg_sq"], sum(files.values())
    by = moved["read_by_kind"]
    grads = by.get("grad", 0)
    if DEVICE == "cpu":
        say(f"\noffload to disk ({name}): each rank's AdamW m and v"
            + (", its shards" if name == "zero3" else "") + " and reduced gradients live in files,\n"
            "  stepped in chunks; in memory stay the weights"
            + (" of the unit being computed" if name == "zero3" else " (all of them at stage 1, 2)")
            + ", the activations\n  and two chunks of buffers per kind")
    else:                            # parallel/offload.py's docstring: on a device, m and v only
        mv = by.get("exp_avg", 0) + by.get("exp_avg_sq", 0)
        say(f"\noffload to disk ({name}): each rank's AdamW m and v live in files, stepped in chunks on\n"
            f"  the device: each chunk crosses to the device and back, m and v {fmt_bytes(mv)} each way a\n"
            "  step, counted in the host<->device bytes per step; stage 3's shards and the reduced\n"
            "  gradients stay in device memory (the gather and the clipping read them there)")
    say(f"  resident memory one step of {name} added, largest rank: in memory {fmt_bytes(grew0)}, "
        f"offloaded {fmt_bytes(grew1)}\n  (difference {fmt_bytes(grew0 - grew1)}, beside the {fmt_bytes(kept)} per rank "
        f"kept in files; glibc keeps freed\n  memory unless MALLOC_MMAP_THRESHOLD_=131072: small models blur it)")
    say(f"  the step read, per rank: m and v {fmt_bytes(by.get('exp_avg', 0) + by.get('exp_avg_sq', 0))}"
        + (f", shards {fmt_bytes(by.get('param', 0))}" if shards else "")
        + f", gradients {fmt_bytes(grads)}")
    say(f"  the whole step, slowest rank: {t0 * 1e3:.1f} ms in memory, {t1 * 1e3:.1f} ms offloaded\n"
        f"  (one step each: compare, do not quote)")
    say(f"  the optimizer step alone, slowest rank, best of 6: each chunk read in turn {serial * 1e3:.1f} ms;\n"
        f"  the next chunk read by a second thread while this one steps {ahead * 1e3:.1f} ms: "
        f"ratio {serial / ahead:.2f}")
    say(f"  (reading took {reading * 1e3:.1f} ms of the step in turn: overlap can hide at most that, a ratio"
        f" of at\n  most {serial / max(serial - reading, reading, 1e-12):.2f}, and only with a core free"
        f" for the reader)")
    cores = os.cpu_count() or 1
    if comm.Get_size() >= cores:
        say(f"  ({harness.ranks(comm.Get_size())} on {cores} cores: no core is free for the reader threads,"
            f" so expect no gain here)")
    return {"rss_added_in_memory": grew0, "rss_added_offloaded": grew1, "state_bytes": state,
            "files_bytes": kept, "step_s_in_memory": t0, "step_s_offloaded": t1, "optimizer_step_s_in_turn": serial,
            "optimizer_step_s_prefetched": ahead, "optimizer_step_s_reading": reading, "prefetch_speedup": serial / ahead, **moved}


def run_meta(args, step):
    """What a resumed run needs besides the tensors. The batches, the learning rate and the
    dropout masks are functions of (seed, step, sample) here, so the step is the data
    position, the schedule's position and the RNG state at once: nothing else to store."""
    return {"seed": args.seed, "batch_size": args.batch_size, "data": {"position": step, "split": "train"},
            "lr": {"schedule": "constant", "value": args.lr}, "rng": "dropout from (seed, step, sample)"}


def describe_save(path, comm):
    """Lines about one checkpoint: its files, bytes per rank, pieces per rank."""
    index = load_index(path)
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
    formula = checkpoint_data_bytes(psi, item)
    lines.append(f"  all files {fmt_bytes(files)}, of which data {data:,} B (after each header); by formula, weights, m\n"
                 f"  and v, 3 x {psi:,} parameters x {item} B, + 8 B (the step) = {formula:,} B")
    return lines


def pasteable(command, indent="    ", width=96):
    """A shell command over lines of at most `width` columns, each but the last ending in \\."""
    lines, line = [], indent
    for word in command.split():
        if len(line) + len(word) + 3 > width and line.strip():
            lines.append(line + " \\")
            line = indent + "    "
        line += ("" if not line.strip() else " ") + word
    return "\n".join(lines + [line])


def describe_reads(reads):
    """Lines: the bytes the load needed, read, and read to check checksums, summed over the ranks."""
    extra = reads["read"] - reads["needed"]
    how = ("no byte more than needed\n  (of a piece that overlaps only in part, only the overlap:"
           " one seek and read per run)" if extra <= 0 else
           f"{extra:,} B more\n  (a box out of box pieces reads each overlapping piece whole)")
    return [f"  all ranks: the new layout's regions {reads['needed']:,} B (a replicated tensor counts for"
            f" each rank\n  that holds it); tensor bytes read {reads['read']:,} B: {how}",
            f"  the sha256 checks read each file a rank opened, in full, once: {reads['checked']:,} B"]


def transfer_figures(recorded, steps_before):
    """The interrupted run's host<->device bytes per step, over both parts (0 on the CPU), and on
    a device a line for each part: the layouts move different bytes (equivalence.record_run's
    records of layout_runs.train; the save and the load are not steps, and are not in it)."""
    parts = list(recorded)           # every run since the reference's: part 1, then part 2
    nbytes, steps = sum(r[1] for r in parts), sum(r[2] for r in parts)
    if DEVICE != "cpu" and parts:
        first = [r for r, done in zip(parts, itertools.accumulate(r[2] for r in parts)) if done <= steps_before]
        for label, rs in (("part 1", first), ("part 2", parts[len(first):])):
            n = sum(r[2] for r in rs)
            if n:
                say(f"  host<->device during the steps of {label}: {fmt_bytes(sum(r[1] for r in rs) / n)} per step")
    return nbytes / max(1, steps)


def explain_mismatch(want, got, resumed_at, args, tol, first_step=0):
    """Lines after a MISMATCH: where along the run the losses parted, and what that suggests.
    want, got: the losses compared, the first of step `first_step`; resumed_at: the index
    of the first loss after the resume (0: the run began with the resume)."""
    rel = [abs(a - b) / max(abs(a), 1e-300) for a, b in zip(want, got)]
    first = next((i for i, r in enumerate(rel) if r > tol), None)
    if first is None:
        return ["  the losses agree within the tolerance; the final weights differ: the last steps",
                "  drifted, or the last update after the resume went wrong (compare more steps)"]
    out = [f"  the losses' relative difference: {rel[0]:.1e} at step {first_step}"
           + (f", {rel[resumed_at - 1]:.1e} at the save (step {first_step + resumed_at - 1})" if resumed_at else ""),
           f"  and {rel[-1]:.1e} at the last step; first beyond {tol:.0e} at step {first_step + first}"]
    if resumed_at and first < resumed_at:
        out += ["  It grew before the resume: drift, not a resume bug. Another layout sums in another",
                "  order (differences of 1e-16 a step); a large learning rate over many steps",
                f"  (--lr {args.lr:g}, {args.steps} steps) amplifies them step after step, as chaotic",
                "  dynamics do. A resume bug (a state not saved or not restored: m, v, the step count,",
                "  the data position) shows as a jump just after the resume. The 1e-10 check is for",
                "  short runs: try fewer --steps or a smaller --lr."]
    else:
        out += [f"  They parted at step {first_step + first}, at or after the resume (step "
                f"{first_step + resumed_at}), not before:",
                "  suspect the resume (a state not saved or not restored: m, v, the step count, the",
                "  data position), not drift; a difference that grows slowly over many steps at a large",
                "  learning rate can still be drift: rerun with fewer --steps or a smaller --lr."]
    return out


def killed_save(root, latest_before):
    """A save killed by SIGKILL after its index is written, before it is published: run in a
    child process (one process that loads the latest checkpoint and saves it again)."""
    code = ("import os,sys; os.environ['MINIDIST_CKPT_KILL_AT']='after-index'\n"
            "from minidist.checkpoint import index, read, store\n"
            "ck = index.resolve(sys.argv[1]); ix = index.load_index(ck)\n"
            "pieces = [{'name': n, 'global_shape': tuple(t['shape']), 'dtype': t['dtype'], 'box': [[0, s] for s in t['shape']],"
            " 'array': read.read_global(ck, ix, n)} for n, t in ix['tensors'].items()]\n"
            "store.save(None, sys.argv[1], ix['step'] + 1000, pieces, ix['meta'])\n")
    env = dict(os.environ)
    for k in list(env):                  # the child is one plain process, not a rank of this job
        if k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_")):
            del env[k]
    proc = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, env=env, timeout=120)
    left = sorted(f for f in os.listdir(root) if f.startswith(".tmp-"))
    after = resolve(root)
    problems = reader.verify(root)
    return proc.returncode, left, after, problems


def make_root(comm, args):
    """The checkpoints' folder on every rank: --dir (made if missing), or a new temporary one.
    A folder that cannot be made or written is one line and exit 2 on every rank."""
    problem, root = "", ""
    if comm.Get_rank() == 0:
        try:
            if args.dir:
                root = os.path.abspath(args.dir)
                os.makedirs(root, exist_ok=True)
                if not os.access(root, os.W_OK | os.X_OK):
                    problem = f"--dir {args.dir}: the folder {root} is not writable"
            else:
                root = tempfile.mkdtemp(prefix="minidist-l11-")
        except OSError as e:
            problem = f"--dir {args.dir}: cannot make {root} ({e.strerror or e})"
    problem = shared_text(comm, problem)
    harness.need(not problem, problem)
    return shared_text(comm, root)


def _interrupted(signum, frame):
    """SIGTERM (a scheduler's, or mpiexec passing one on) as Ctrl-C: the finally blocks run."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(args):
    comm = harness.comm_world()
    world = comm.Get_size()
    args.grad_accum = 1
    cfg = common.config_from_args(args, world)
    check_input(args, cfg, world)
    data = common.load_dataset(args, comm)
    root = make_root(comm, args)
    # a temporary folder goes whatever way the run ends; only a main thread may set a handler
    # (the grader runs lessons in a worker thread), and the caller's is put back at the end
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _interrupted) if not args.dir and main_thread else None
    done = False
    try:
        code = lesson(comm, args, cfg, data, root)
        done = True
        return code
    finally:     # normal end: rank 0, after the others; any other end: every rank, at once (the
        if not args.dir and (comm.Get_rank() == 0 or not done):    # first to abort ends them all)
            shutil.rmtree(root, ignore_errors=True)               # (SIGKILL alone leaves it)
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def lesson(comm, args, cfg, data, root):
    rank, world = comm.Get_rank(), comm.Get_size()
    say(f"Lesson 11: checkpoints on {harness.ranks(world)}: save under {args.save_layout}, "
        f"resume under {args.resume_layout}\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} {cfg.dtype}, global batch "
        f"{args.batch_size}, {args.steps} AdamW steps\ncheckpoints in {root}"
        + ("" if args.dir else "\n  (a temporary folder, removed at the end: --dir PATH keeps them)"))

    # the run that is never interrupted: one process on every rank (a small model)
    from mpi4py import MPI
    ref = runs.build("single", MPI.COMM_SELF, cfg, args.seed, args.lr)
    ref_losses = runs.train(ref, data, args.batch_size, 0, args.steps, args.lr, args.grad_clip, args.seed)

    first, save_lines, killed, saved_d2h = [], [], None, 0
    mark = len(equivalence.RUNS)                 # the interrupted run's training, recorded from here
    try:
        if args.resume:
            path = os.path.abspath(args.resume)
        else:
            run = runs.build(args.save_layout, comm, cfg, args.seed, args.lr, **offload_kw(args, root, "part1"))
            say(f"\npart 1: {run.describe()}, steps 0-{args.stop_at - 1}, a save every {args.save_every}")
            for start in range(0, args.stop_at, args.save_every):
                stop = min(args.stop_at, start + args.save_every)
                first += runs.train(run, data, args.batch_size, start, stop, args.lr, args.grad_clip, args.seed)
                t0, crossed = time.perf_counter(), transfers.snapshot()
                path = layouts.save(comm, root, stop, run.model, run.opt, run.zero, meta=run_meta(args, stop),
                                    keep=args.keep)
                save_lines.append((stop, time.perf_counter() - t0))
                saved_d2h = transfers.BYTES["d2h"] - crossed["d2h"]     # the pieces brought home
            say(f"  saved at steps {', '.join(str(s) for s, _ in save_lines)}; kept {args.keep}: "
                f"{', '.join(sorted(f for f in os.listdir(root) if f.startswith('step')))}")
            say(f"  the last save, {os.path.basename(path)}: {save_lines[-1][1] * 1e3:.1f} ms; one file per rank:")
            for line in describe_save(path, comm):
                say(line)
            if args.dir:
                say(f"  every piece, and which rank wrote it:\n    python -m minidist.checkpoint show {path}")
            else:                     # this run's folder is gone when the student reads this
                say(f"  every piece, and which rank wrote it (this run's folder is removed at the end):\n"
                    f"{pasteable(harness.command_with(world, {'--dir': 'ckpts'}))}\n"
                    f"    python -m minidist.checkpoint show ckpts/{os.path.basename(path)}")
            if args.kill and rank == 0:
                killed = killed_save(root, path)
            comm.Barrier()
        # part 2: resume under the other layout
        resumed = runs.build(args.resume_layout, comm, cfg, args.seed + 1, args.lr,   # other weights: all replaced
                             **offload_kw(args, root, "part2"))
        reader.reset_reads()
        t0, crossed = time.perf_counter(), transfers.snapshot()
        meta = layouts.load(comm, path, resumed.model, resumed.opt, resumed.zero)
    except CheckpointError as e:
        raise harness.InputError(str(e))
    load_s = time.perf_counter() - t0
    loaded_h2d = transfers.BYTES["h2d"] - crossed["h2d"]          # the regions sent to the device
    reads = dict(zip(("needed", "read", "checked"), common.mpi_reduce(
        comm, [reader.READS[k] for k in ("needed", "read", "checked")], op="sum").astype(int).tolist()))
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
        f"  loaded {os.path.basename(resolve(path))} (saved by {meta['layout']['kind']} on "
        f"{harness.ranks(meta['layout']['ranks'])}) in {load_s * 1e3:.1f} ms")
    for line in describe_reads(reads):
        say(line)
    rest = runs.train(resumed, data, args.batch_size, start, args.steps, args.lr, args.grad_clip, args.seed)
    moved = transfer_figures(equivalence.RUNS[mark:], len(first))
    if DEVICE != "cpu":              # not steps: a save and a load cross once, all the state at once
        save_all, load_all = common.mpi_reduce(comm, [saved_d2h, loaded_h2d], op="sum")
        say(f"  all ranks: the last save brought {int(save_all):,} B home (device to host), the load "
            f"sent\n  {int(load_all):,} B to the devices (host to device)")
    final = layouts.save(comm, root, args.steps, resumed.model, resumed.opt, resumed.zero, keep=args.keep)
    got = {n: reader.read_global(final, load_index(final), f"model.{n}") for n, _ in ref.model.named_parameters()}

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
                                         "load_bytes_needed": reads["needed"], "load_bytes_read": reads["read"],
                                         "load_bytes_checksummed": reads["checked"],
                                         "resumed_from_step": start, "offload": offload,
                                         "host_device_bytes_per_step": moved,
                                         "killed_save_left_latest_intact": None if killed is None else
                                         bool(not killed[3] and killed[2] == resolve(path))})
    if not report["match"]:
        for line in explain_mismatch(have, losses, len(first), args, tol, 0 if not args.resume else start):
            say(line)
    comm.Barrier()                    # every rank is done with the folder before rank 0 removes it
    return harness.finish(report, args)


if __name__ == "__main__":
    harness.run(main, build_parser())
