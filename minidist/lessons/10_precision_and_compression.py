"""Lesson 10: mixed precision, gradient compression and curriculum learning, measured on
the real task. None of them is exact by design, so each is checked exactly where an exact
check exists, and otherwise trained: the same model, corpus and tokens under each
variant, data-parallel on the job's ranks, validation loss against tokens.

    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression
    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --precision bf16
    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --compressor 1bit-adam
    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --compressor 1bit --warmup-steps 40
    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --compressor powersgd --rank 4
    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --curriculum --plot curves.png
    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --precision bf16 --zero 2

Variants (minidist/precision.py, minidist/parallel/compression.py, minidist/curriculum.py):
fp32; bf16 and fp16 with fp32 master weights (fp16 with dynamic loss scaling, optionally
with hysteresis); fp16, int8, 1-bit (error feedback, uncompressed warm-up: "1bit-grad") and
PowerSGD compression of the gradients; 1-bit Adam (the momentum compressed after an fp32
warm-up, the variance frozen: "1bit-adam"); sequence-length warm-up. Printed: the exact
checks and their verdicts; the memory per parameter of each precision, measured from the
arrays, beside the ZeRO paper's and Megatron's accountings; a table (final validation loss,
gap to fp32, bytes per step measured beside the formula, compression per step and over the
run, step time); the curves as text (and --plot PATH: a PNG). The exit code is 0 only when
every exact check holds and every step's bytes equal the formula; the convergence goals are
reported beside, as measurements.
"""
import argparse

import numpy as np

from minidist.lessons import common, harness
from minidist.lessons.convergence import Variant, curve_plot, png_plot, run_variant
from minidist.lessons.harness import fmt_bytes, positive_float, positive_int, say
from minidist.lessons import precision_checks as checks
from minidist.parallel.compressors import COMPRESSORS

GOALS = {"bf16": 0.02, "fp16": 0.02, "1bit": 0.05, "1bit-adam": 0.05, "powersgd": 0.05}   # gap to fp32


def compressor_name(text):
    """--compressor's check: argparse's own message lists the choices and runs past 100 columns."""
    if text not in COMPRESSORS:
        raise argparse.ArgumentTypeError(f"{text!r} is unknown")
    return text


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=200, dtype="float32")
    common.add_model_flags(p, n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16)
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g = p.add_argument_group("variants (give any of these to run that variant alone, beside fp32)")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    g.add_argument("--compressor", type=compressor_name, metavar="{" + ",".join(COMPRESSORS) + "}",
                   help="1bit: 1-bit gradients with error feedback; 1bit-adam: 1-bit Adam (the momentum)")
    g.add_argument("--rank", type=positive_int, default=4, help="PowerSGD's rank r (default %(default)s)")
    g.add_argument("--warmup-steps", type=harness.nonnegative_int, default=None,
                   help="1-bit variants and PowerSGD: uncompressed steps first (default: 1-bit 25%% "
                        "of --steps, PowerSGD 0)")
    g.add_argument("--no-freeze-variance", dest="freeze_variance", action="store_false",
                   help="1bit (1-bit gradients): keep updating AdamW's v after the warm-up")
    g.add_argument("--curriculum", action="store_true", help="sequence-length warm-up")
    g.add_argument("--ramp-steps", type=positive_int, default=None,
                   help="curriculum: steps from --seq-start to block_size (default: 30%% of --steps)")
    g.add_argument("--seq-start", type=positive_int, default=8, help="curriculum: first length (default 8)")
    m = p.add_argument_group("mixed precision")
    m.add_argument("--grad-reduce", choices=["fp32", "16"], default="fp32",
                   help="bf16: reduce the gradients in fp32 (Megatron's default) or 16 bits; fp16 always 16")
    m.add_argument("--grad-dtype", choices=["fp32", "16"], default="fp32",
                   help="bf16: store the gradients in fp32 (Megatron's main_grad) or 16 bits")
    m.add_argument("--init-scale", type=positive_float, default=2.0 ** 16, help="fp16 loss scale at first")
    m.add_argument("--growth-interval", type=positive_int, default=2000,
                   help="fp16: good steps in a row before the scale doubles (default %(default)s)")
    m.add_argument("--hysteresis", type=positive_int, default=1,
                   help="fp16: overflows since the scale last grew before it halves (PyTorch 1, "
                        "Megatron and DeepSpeed 2)")
    m.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                   help="ZeRO stage for the precision variants (16-bit reduce-scatter with --grad-reduce 16)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-interval", type=positive_int, default=25, help="steps between validation losses")
    e.add_argument("--eval-iters", type=positive_int, default=4, help="validation batches (default %(default)s)")
    harness.add_output(p, "--plot", help="write the validation curves as a PNG (needs matplotlib)")
    return p


def variants(args):
    """The variants this run trains: all of them, or the one the flags name, beside fp32."""
    w = args.warmup_steps
    w = max(1, args.steps // 4) if w is None else w
    base = Variant("fp32")
    if not (args.precision or args.compressor or args.curriculum):
        return [base, Variant("bf16", "bf16"), Variant("fp16", "fp16"),
                Variant("comp fp16", compressor="fp16"), Variant("int8", compressor="int8"),
                Variant(f"1bit-grad w={w}", compressor="1bit", warmup_steps=w,
                        freeze_variance=args.freeze_variance),
                Variant(f"1bit-adam w={w}", compressor="1bit-adam", warmup_steps=w),
                Variant(f"powersgd r={args.rank}", compressor="powersgd", rank=args.rank, warmup_steps=0),
                Variant("curriculum", curriculum=True)]
    precision, comp = args.precision or "fp32", args.compressor or "none"
    parts = [precision] if precision != "fp32" else []
    parts += {"none": [], "1bit": [f"1bit-grad w={w}"], "1bit-adam": [f"1bit-adam w={w}"],
              "powersgd": [f"powersgd r={args.rank}"]}.get(comp, [comp])
    parts += ["curriculum"] if args.curriculum else []
    warm = w if comp in ("1bit", "1bit-adam") else (args.warmup_steps or 0) if comp == "powersgd" else 0
    v = Variant(" + ".join(parts) or "fp32", precision, comp, args.rank, warm, args.curriculum,
                comp == "1bit" and args.freeze_variance)
    return [base] if v.name == "fp32" else [base, v]


def check_input(args, world):
    harness.need(args.grad_clip >= 0, f"--grad-clip must be 0 or more, got {args.grad_clip}")
    w = args.warmup_steps
    harness.need(w is None or w < args.steps,
                 f"--warmup-steps {w} is not below --steps {args.steps}: nothing to compress"
                 + (f" (try {max(1, args.steps // 4)})" if args.steps > 1 else ""))
    harness.need(not (args.compressor == "1bit-adam" and w == 0),
                 "--compressor 1bit-adam needs --warmup-steps 1 or more: it freezes Adam's v after them")
    from minidist.backend import DEVICE
    bf16_reduce = args.grad_reduce == "16" and args.precision in (None, "bf16")
    harness.need(DEVICE == "cpu" or not bf16_reduce,      # the ring sums in the wire's dtype
                 f"--grad-reduce 16 sums bf16, a dtype MINIDIST_DEVICE={DEVICE} lacks: use fp32")
    harness.need(args.seq_start <= args.block_size,
                 f"--seq-start {args.seq_start} is longer than --block-size {args.block_size}")
    if args.zero:
        harness.need(not args.compressor or args.compressor == "none",
                     "--zero reduce-scatters the gradients itself: it does not combine with --compressor")
        harness.need(world > 1, "--zero shards over the data-parallel ranks: run it on 2 or more")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise harness.InputError("--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)")


def main(args):
    comm = harness.comm_world()
    rank, world = comm.Get_rank(), comm.Get_size()
    args.grad_accum = 1
    check_input(args, world)
    args.ramp_steps = args.ramp_steps or max(1, (3 * args.steps) // 10)
    cfg = common.config_from_args(args, world)
    rows = common.batch_rows(args, rank, world)
    data = common.load_dataset(args, comm)
    total_tokens = args.steps * args.batch_size * cfg.block_size
    runs = variants(args)
    if args.compressor == "powersgd" or any(v.compressor == "powersgd" for v in runs):
        largest = max(min(s) for s in checks.matrix_shapes(cfg, args.seed))
        harness.need(args.rank <= largest, f"--rank {args.rank} is more than the largest matrix allows: "
                     f"{largest}, its smaller side")
    say(f"Lesson 10: mixed precision, gradient compression and curriculum learning, data-parallel on "
        f"{harness.ranks(world)}\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size}, "
        f"{checks.param_count(cfg, args.seed):,} parameters")
    say(f"budget  {total_tokens:,} tokens per variant = {args.steps} steps x {args.batch_size} sequences x "
        f"{cfg.block_size} tokens\n        AdamW, peak lr {args.lr:g}, warm-up over {args.steps // 20} steps "
        f"then a cosine over the tokens left")

    # --- the exact checks first: they hold or the lesson fails
    exact = checks.run_all(args, cfg, comm, data, rows)
    say("\nexact checks (each must hold bit for bit, or to the tolerance named):")
    for c in exact:
        say(f"  {'ok  ' if c['ok'] else 'FAIL'}  {c['what']}\n        {c['measured']}")

    # --- the convergence runs
    say(f"\ntraining {len(runs)} variant(s), {total_tokens:,} tokens each:")
    results = []
    for v in runs:
        r = run_variant(v, args, cfg, comm, data, rows, total_tokens)
        results.append(r)
        say(f"  {v.name:<16} val loss {r['val_loss']:.4f} after {r['steps']} steps")
    after = checks.after_runs(results, runs)
    if after:
        say("\nexact checks after the runs:")
    for c in after:
        say(f"  {'ok  ' if c['ok'] else 'FAIL'}  {c['what']}\n        {c['measured']}")
    exact += after
    base = results[0]
    table_rows, json_rows, bytes_ok = [], [], True
    uncompressed = base["sent"][-1]
    for v, r in zip(runs, results):
        sent, expected = r["sent"], r["expected"]
        ok = sent == expected
        bytes_ok &= ok
        per_step = sent[-1]
        gap = (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        ratio_step = per_step / uncompressed if uncompressed else float("nan")
        ratio_run = sum(sent) / (base["steps"] * uncompressed) if uncompressed else float("nan")
        table_rows.append([v.name, f"{r['val_loss']:.4f}", f"{100 * gap:+.2f}%", fmt_bytes(per_step),
                           fmt_bytes(expected[-1]) + ("" if ok else " !"), f"{ratio_step:.4f}",
                           f"{ratio_run:.4f}", f"{1e3 * r['step_time_s']:.1f}"])
        json_rows.append({"variant": v.name, "precision": v.precision, "compressor": v.compressor,
                          "curriculum": v.curriculum, "val_loss": r["val_loss"], "gap_to_fp32": gap,
                          "steps": r["steps"], "tokens": r["tokens"], "bytes_per_step": per_step,
                          "bytes_per_step_formula": expected[-1], "bytes_match_every_step": ok,
                          "bytes_run": sum(sent), "ratio_per_step": ratio_step, "ratio_run": ratio_run,
                          "step_time_s": r["step_time_s"], "curve": r["curve"],
                          "host_device_bytes_per_step": r["host_device_bytes_per_step"],
                          "skipped_steps": r["scaler"].skipped if r["scaler"] else 0})
    say("\nafter the same tokens:")
    if args.zero:
        say(f"  under --zero {args.zero} every variant, fp32 included, runs ZeRO-{args.zero}: \"fp32's all-reduce\" below\n"
            f"  is the fp32 run's reduce-scatter and all-gather; the 16-bit variants keep fp32 weights\n"
            f"  (autocast rounds them at each use), so there are no master rows and no master checks")
    say("  bytes/step: what this rank sent in the last step, measured, beside the formula")
    say("  per step, whole run: those bytes over fp32's all-reduce, in one step and over the run\n"
        "  (a warm-up's uncompressed steps and the curriculum's extra steps included)")
    harness.table(table_rows, header=["variant", "val loss", "gap", "bytes/step", "formula", "per step",
                                      "whole run", "ms/step"])
    say("  (compare step times within this run only: the 16-bit formats are emulated on float32 arrays,\n"
        "   so on a CPU they cost time instead of saving it: lessons/10_precision_and_compression.md)")
    checks.print_memory(results, runs, world)
    goals = checks.goals(json_rows, runs, GOALS)
    if goals:
        say("\ngoals, measured:")
    for line in goals:
        say(f"  {line}")
    say("")
    for line in curve_plot(results):
        say(line)
    if args.plot and harness.is_root():
        png_plot(results, args.plot)
        say(f"curves written to {args.plot}")
    ok = all(c["ok"] for c in exact) and bytes_ok
    say(f"\nbytes sent equal the formula at every step of every variant: {'yes' if bytes_ok else 'NO'}")
    worst = max((c.get("rel", 0.0) for c in exact), default=0.0)
    report = harness.new_report(
        "10_precision_and_compression", args, parallel={"dp": world, "zero": args.zero}, match=ok,
        max_rel_diff=worst, tolerance=checks.TOLERANCE, losses=base["losses"],
        comm={"bytes_per_step_fp32": uncompressed},
        step_time_s=base["step_time_s"],
        figures={"variants": json_rows, "exact_checks": [{k: c[k] for k in ("what", "ok", "measured")} for c in exact],
                 "memory": checks.memory_rows(results, runs, world), "total_tokens": total_tokens})
    report["variants"] = json_rows          # one row per variant (also under figures)
    return harness.finish(report, args)


if __name__ == "__main__":
    harness.run(main, build_parser())
