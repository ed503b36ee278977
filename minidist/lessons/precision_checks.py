"""Lesson 10's exact checks, memory table and goals: what holds bit for bit (or to a named
tolerance) although the variants themselves are not exact.

- loss scaling: in fp32 arithmetic, backward of loss x 2^16 then / 2^16 gives the plain
  gradients bit for bit (a power of two only moves exponents), through the package's
  unscale_grads (exercise 10.1's function);
- PowerSGD at full rank r = min(n, m) equals the exact average (exercise 10.3's step);
- 1-bit error feedback over several steps: the sum of what was applied equals the sum of
  the gradients minus the residual still held (exercise 10.2's function); and the same
  for 1-bit Adam's compressed all-reduce on the job's ranks, with the worker residuals
  (their mean) and the servers' residuals held;
- after the bf16 run: the model's weights are the fp32 masters rounded to bf16, by a
  reference written here on the float32 bits (round to nearest, ties to even), not by
  the ml_dtypes cast the package uses;
- after the fp16 run: no weight or master is inf or nan (every overflowed step skipped).

On a device the package's functions are given device arrays (to_device) and their results
come home for the comparison (to_numpy): the checks test the device path itself.
"""
import numpy as np

from minidist.backend import to_device, to_numpy

from minidist.lessons.harness import say, table
from minidist.plan.memory import bytes_per_param

TOLERANCE = 1e-10          # float64 checks (PowerSGD, error feedback); the others are bit for bit


def _model(cfg, seed):
    from minidist.model import GPT
    return GPT(cfg, seed=seed)


def param_count(cfg, seed):
    return sum(p.size for p in _model(cfg, seed).parameters())


def matrix_shapes(cfg, seed):
    """The (n, m) of every parameter PowerSGD compresses (2-D and up, as (shape[0], rest))."""
    return [(p.shape[0], p.size // p.shape[0]) for p in _model(cfg, seed).parameters() if p.ndim >= 2]


def _rel(a, b):
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / scale if a.size else 0.0


def loss_scaling_exact(args, cfg, data, rows):
    from minidist import precision
    x, y = (a[rows] for a in data.get_batch("train", args.batch_size, 0))
    grads = []
    for scale in (1.0, 2.0 ** 16):
        model = _model(cfg, args.seed)
        _, loss = model(x, y)
        (loss * scale).backward()
        grads.append([p.grad for p in model.parameters()])
    unscaled, found = precision.unscale_grads(grads[1], 2.0 ** 16)
    # unscaled gradients are fp32 (the masters' dtype): the plain ones, in fp32, bit for bit
    same = not found and all(np.array_equal(to_numpy(a), to_numpy(b).astype(np.float32))
                             for a, b in zip(unscaled, grads[0]))
    return {"what": "loss scaling: backward of loss x 2^16, unscaled, gives the plain gradients",
            "ok": same, "measured": "bit for bit" if same else "differs", "rel": 0.0}


def powersgd_full_rank(comm, seed):
    from minidist.comm import ring_all_reduce
    from minidist.parallel import compression
    rng = np.random.default_rng([seed, comm.Get_rank()])
    M = to_device(rng.standard_normal((12, 7)))
    Q = to_device(np.random.default_rng(seed).standard_normal((7, 7)))
    approx, _ = compression.powersgd_step(comm, M, Q)
    exact = ring_all_reduce(comm, M) / comm.Get_size()
    rel = comm.allreduce(_rel(approx, exact), op=_max())
    return {"what": "PowerSGD at full rank (r = 7, a 12 x 7 matrix per rank) equals the exact average",
            "ok": rel <= TOLERANCE, "measured": f"max_rel_diff {rel:.1e}", "rel": rel}


def error_feedback_identity(seed, steps=6, n=203):
    from minidist.parallel import compression
    rng = np.random.default_rng(seed)
    residual, applied, true, worst = to_device(np.zeros(n)), np.zeros(n), np.zeros(n), 0.0
    for _ in range(steps):
        g = rng.standard_normal(n)
        packed, scale, residual = compression.onebit_compress(to_device(g), residual)
        applied += to_numpy(compression.onebit_decompress(packed, scale, n))
        true += g
        worst = max(worst, _rel(applied, true - to_numpy(residual)))     # every step
    return {"what": f"1-bit gradients, error feedback, {steps} steps: sum applied = sum gradients - residual held",
            "ok": worst <= TOLERANCE, "measured": f"max_rel_diff {worst:.1e}", "rel": worst}


def onebit_adam_feedback(comm, seed, steps=6, n=203):
    """1-bit Adam's compressed all-reduce (worker and server residuals), several steps on this
    job's ranks: sum of outputs = sum of true averages - mean worker residual - server
    residuals, every step, and every rank gets the same output."""
    from minidist.comm import chunk_bounds, ring_all_reduce
    from minidist.parallel import compression
    N, me = comm.Get_size(), comm.Get_rank()
    b = chunk_bounds(n, N)
    worker, server = to_device(np.zeros(n)), to_device(np.zeros(b[me + 1] - b[me]))
    out_sum, true_sum, worst = np.zeros(n), np.zeros(n), 0.0
    for step in range(steps):
        xs = [np.random.default_rng([seed, step, r]).standard_normal(n) + 0.2 for r in range(N)]
        out = to_numpy(compression.compressed_allreduce(comm, to_device(xs[me]), worker, server))
        out_sum += out
        true_sum += sum(xs) / N
        held = np.zeros(n)
        held[b[me]:b[me + 1]] = to_numpy(server)
        held = ring_all_reduce(comm, held + to_numpy(worker) / N)   # mean worker + every server's
        worst = max(worst, _rel(out_sum, true_sum - held), _rel(ring_all_reduce(comm, out) / N, out))
    worst = comm.allreduce(worst, op=_max())
    return {"what": f"1-bit Adam's all-reduce, {steps} steps: sum out = sum averages - residuals held",
            "ok": worst <= TOLERANCE, "measured": f"max_rel_diff {worst:.1e} (and the same on every rank)",
            "rel": worst}


def _max():
    from mpi4py import MPI
    return MPI.MAX


def run_all(args, cfg, comm, data, rows):
    return [loss_scaling_exact(args, cfg, data, rows), powersgd_full_rank(comm, args.seed),
            error_feedback_identity(args.seed), onebit_adam_feedback(comm, args.seed)]


def bf16_bits(a):
    """float32 -> the bf16 bit patterns (uint16), rounded to nearest, ties to even: the top
    16 bits of the float32 after adding 0x7FFF plus the lowest kept bit (finite values)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def after_runs(results, runs):
    from minidist.precision import MixedPrecision, load16
    out = []
    for v, r in zip(runs, results):
        opt = r["opt"]
        if not isinstance(opt, MixedPrecision):
            continue
        masters = [to_numpy(opt.master[id(p)].data) for p in opt.params]
        weights = [to_numpy(p.data) for p in opt.params]
        if v.precision == "bf16":
            w16 = [to_numpy(w).view(np.uint16) for w in opt.weights16]   # bf16 or its bits: 2 bytes
            same = all(np.array_equal(w, bf16_bits(m)) for w, m in zip(w16, masters))
            same &= all(np.array_equal(p, to_numpy(load16(w, opt.dt)))
                        for p, w in zip(weights, opt.weights16))
            out.append({"what": f"{v.name}: the weights are the fp32 masters rounded to bf16 by bit arithmetic",
                        "ok": same,
                        "measured": "bit for bit" if same else "differs", "rel": 0.0})
        if v.precision == "fp16":
            finite = all(np.all(np.isfinite(a)) for a in masters + weights)
            sc = r["scaler"]
            out.append({"what": f"{v.name}: no inf or nan reached the weights ({sc.skipped} overflowed "
                                f"step(s) skipped, scale now {sc.scale:g})", "ok": finite,
                        "measured": "all finite" if finite else "NOT finite", "rel": 0.0})
    return out


# ----------------------------------------------------------------------------- memory

FORMULAS = {"fp32": (bytes_per_param("fp32"), "fp32: 4 + 4 + 8 (weights, gradients, AdamW m and v)"),
            "bf16": (bytes_per_param("megatron"), "Megatron bf16: 2 + 4 + 12 (fp32 gradients, main_grad)"),
            "fp16": (bytes_per_param("zero"), "ZeRO paper fp16: 2 + 2 + 12 (K = 12)")}


def memory_rows(results, runs, world):
    """Bytes per parameter by category, measured from this rank's arrays after the run."""
    from minidist.precision import MixedPrecision
    rows = []
    for v, r in zip(runs, results):
        if v.compressor != "none" or v.curriculum:
            continue
        opt, model = r["opt"], r["model"]
        params = list(model.parameters())
        n = sum(p.size for p in params)
        if isinstance(opt, MixedPrecision):
            mem = opt.memory()
            if v.precision == "bf16" and opt.grad_dt.itemsize == 2:
                formula = (bytes_per_param((2, 2, 12)), "bf16 with 16-bit gradients: 2 + 2 + 12")
            else:
                formula = FORMULAS[v.precision]
        elif hasattr(opt, "memory"):          # ZeRO: its own table (lesson 05); not this one's
            continue
        else:
            mem = {"weights": sum(p.data.nbytes for p in params),
                   "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
                   "master": 0, "optimizer": opt.state_bytes()}
            formula = FORMULAS["fp32"]
        per = {k: b / n for k, b in mem.items()}
        rows.append({"variant": v.name, **per, "total": sum(per.values()), "formula": formula[0],
                     "source": formula[1]})
    return rows


def print_memory(results, runs, world):
    rows = memory_rows(results, runs, world)
    if not rows:
        return
    say("\nmodel states per parameter, measured from the arrays this rank holds, beside the accounting:")
    table([[r["variant"], f"{r['weights']:g}", f"{r['grads']:g}", f"{r['master']:g}", f"{r['optimizer']:g}",
            f"{r['total']:g}", f"{r['formula']:g}  ({i + 1})"] for i, r in enumerate(rows)],
          header=["precision", "weights", "grads", "master", "m + v", "total", "formula"])
    for i, r in enumerate(rows):
        say(f"  ({i + 1}) {r['source']}")
    d = world
    say(f"  Megatron's distributed optimizer shards master, m and v (12 bytes) over d data-parallel ranks:\n"
        f"  6 + 12/d = {bytes_per_param('megatron', d, 1):g} bytes per parameter at d = {d} (a formula here; lesson 05 measures sharding)")


def goals(rows, runs, targets):
    lines = []
    for v, r in zip(runs, rows):
        key = v.precision if v.precision != "fp32" else v.compressor
        if key not in targets or v.curriculum or (v.precision != "fp32" and v.compressor != "none"):
            continue
        if v.precision == "fp32" and key in ("bf16", "fp16"):
            continue                               # compression to fp16 has no goal of its own
        gap, goal = r["gap_to_fp32"], targets[key]
        met = "met" if gap <= goal else "NOT met"
        extra = ""
        if v.compressor in ("1bit", "1bit-adam"):
            extra = (f"\n{'':<19}{r['ratio_per_step']:.4f} of fp32's bytes per compressed step "
                     f"(1/32 = {1 / 32:.4f}), {r['ratio_run']:.4f} over the run")
        if v.compressor == "1bit-adam":
            extra += (f"\n{'':<19}{r['bytes_per_step']:,} B per compressed step measured, "
                      f"{r['bytes_per_step_formula']:,} B by plan.traffic.onebit_adam_sent")
        if v.precision == "fp16":
            extra = f"; {r['skipped_steps']} overflowed step(s) skipped"
        lines.append(f"{v.name:<16} gap {100 * gap:+.2f}% (goal within {100 * goal:g}%): {met}{extra}")
    return lines
