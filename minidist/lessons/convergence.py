"""The convergence harness of lesson 10: one model, one corpus, one token budget, several
variants (precision, gradient compression, curriculum), each trained data-parallel on the
job's ranks; validation loss against tokens, bytes sent per step beside its formula.

None of these variants is exact by design, so the question a run answers is the one a
practitioner asks: after the same tokens, is the validation loss as low, and what did
the variant save? `run_variant` trains one; `curve_plot` draws the curves in text;
`png_plot` writes them as a PNG where matplotlib is installed (the `plot` extra).
On a device each variant's host<->device bytes inside train_step are counted (the
evaluations' are not): the row's host_device_bytes_per_step, and the fp32 run's is the
report's (equivalence.record_run).
"""
import contextlib
import dataclasses
import sys
import time

import numpy as np

from minidist import equivalence, transfers
from minidist.comm import stats
from minidist.lessons import common
from minidist.lessons.harness import say
from minidist.progress import Progress


class _SayStream:
    """Progress's stream: lines through harness.say (rank 0 only, captured in tests); a
    terminal's carriage-return updates straight to stdout, on rank 0."""

    def __init__(self):
        from minidist.lessons import harness
        self.root = harness.is_root()
        self.captured = harness.captured() is not None
        self.buf = ""

    def isatty(self):
        return self.root and not self.captured and sys.stdout.isatty()

    def write(self, text):
        if self.isatty():
            sys.stdout.write(text)
            return
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            say(line)

    def flush(self):
        if self.isatty():
            sys.stdout.flush()

DATA = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")   # the data collectives


@dataclasses.dataclass
class Variant:
    name: str
    precision: str = "fp32"
    compressor: str = "none"
    rank: int = 4
    warmup_steps: int = 0
    curriculum: bool = False
    freeze_variance: bool = False     # 1-bit gradients: AdamW's v fixed once the warm-up ends


def _dp_slot(v, model, opt, comm, args):
    """(optimizer, dp slot, formula(): bytes this rank sends in the next step). Under ZeRO
    formula(skipped=True): the bytes of a step the fp16 scaler skipped, whose optimizer
    step (the all-gather of the updated weights) does not run."""
    from minidist.parallel.compression import CompressedDataParallel, OneBitAdam
    from minidist.plan.traffic import ring_bytes
    from minidist.parallel.data_parallel import BucketedDataParallel
    from minidist.precision import MixedPrecision, dtype16
    reduce16 = v.precision != "fp32" and (args.grad_reduce == "16" or v.precision == "fp16")
    reduce_dtype = dtype16(v.precision) if reduce16 else None
    if args.zero:
        from minidist.parallel.zero import ZeRO, expected_sent
        zero = ZeRO(model, opt, comm, args.zero, reduce_dtype=reduce_dtype)
        return zero, zero, lambda skipped=False: sum(
            b for k, b in expected_sent(zero).items() if not (skipped and k == "all_gather"))
    dp = None
    if v.compressor != "none":
        dp = CompressedDataParallel(model, comm, v.compressor, rank=v.rank, warmup_steps=v.warmup_steps,
                                    seed=args.seed)
    if v.compressor == "1bit-adam":      # the optimizer compresses the momentum itself
        opt = OneBitAdam(opt, dp)
    if v.precision != "fp32":
        opt = MixedPrecision(opt, model, v.precision, "16" if v.precision == "fp16" else args.grad_dtype)
    if dp is not None:
        return opt, dp, dp.bytes_formula
    dp = BucketedDataParallel(model, comm, reduce_dtype=reduce_dtype)
    size, rank = comm.Get_size(), comm.Get_rank()
    return opt, dp, lambda: sum(ring_bytes(b.flat.size, size, rank, b.flat.itemsize) for b in dp.buckets)


def evaluate(model, data, args, comm, rows, precision):
    """The validation loss on `eval_iters` fixed batches, each rank its rows, averaged."""
    from minidist.precision import autocast
    from minidist.tensor import no_grad
    model.eval()
    with no_grad(), autocast(precision):
        losses = [model(*(a[rows] for a in data.get_batch("val", args.batch_size, 10**6 + i)))[1].item()
                  for i in range(args.eval_iters)]
    model.train()
    return float(common.mpi_reduce(comm, np.mean(losses), "sum")) / comm.Get_size()


def run_variant(v, args, cfg, comm, data, rows, total_tokens):
    """Train variant v until it has seen total_tokens tokens; return its row of the table."""
    from minidist.curriculum import Curriculum
    from minidist.model import GPT
    from minidist.precision import GradScaler, autocast
    from minidist.train import micro_batches, train_step
    model = GPT(cfg, seed=args.seed)
    opt = model.configure_optimizers(0.1, args.lr)
    scaler = (GradScaler(args.init_scale, 2.0, 0.5, args.growth_interval, comm=comm,
                         hysteresis=getattr(args, "hysteresis", 1))
              if v.precision == "fp16" else None)
    opt, dp, formula = _dp_slot(v, model, opt, comm, args)
    cur = Curriculum(cfg.block_size, args.batch_size, total_tokens, args.ramp_steps, args.seq_start,
                     plain=not v.curriculum, peak_lr=args.lr, min_lr=args.lr / 10,
                     warmup_steps=args.steps // 20)
    curve, sent, expected, times, losses, seqlens, moved = [], [], [], [], [], [], 0
    bar = Progress(total_tokens, f"    {v.name:<16}", stream=_SayStream(), every=1)
    tenth = 0
    while not cur.done():
        L = cur.seqlen()
        x, y = data.get_batch("train", args.batch_size, cur.step)
        x, y = x[rows, :L], y[rows, :L]
        predicted = formula()
        before = transfers.snapshot()
        t0 = time.perf_counter()
        # fp16: an overflow (inf in a gradient, in a 16-bit sum) is expected and handled: the
        # scaler skips that step and halves the scale; NumPy's warnings about it are noise
        quiet = np.errstate(over="ignore", invalid="ignore") if v.precision == "fp16" else contextlib.nullcontext()
        with stats.measure() as m, autocast(v.precision), quiet:
            loss, _ = train_step(model, opt, micro_batches(x, y, cur.step, args.seed, 1, rows.start or 0),
                                 cur.lr(), args.grad_clip, dp=dp, scaler=scaler)
        times.append(time.perf_counter() - t0)
        moved += equivalence.host_device_bytes(before)
        sent.append(sum(m.bytes_sent(n) for n in DATA))
        if args.zero and scaler is not None and scaler.found_inf:
            predicted = formula(skipped=True)         # ZeRO's all-gather did not run
        expected.append(predicted)
        losses.append(loss)
        seqlens.append(L)
        cur.advance(L)
        if v.freeze_variance and cur.step == v.warmup_steps:
            getattr(opt, "inner", opt).freeze_variance()
        if cur.step % args.eval_interval == 0 or cur.done():
            curve.append((cur.tokens, evaluate(model, data, args, comm, rows, v.precision)))
        # one updating line on a terminal; otherwise a plain line at every tenth of the tokens
        if not cur.done() and (bar.tty or 10 * cur.tokens // total_tokens > tenth):
            tenth = 10 * cur.tokens // total_tokens
            bar.update(cur.tokens, f"tokens, step {cur.step} loss {loss:.4f}")
    bar.close()
    if v.name == "fp32":
        equivalence.record_run(moved, cur.step, strategy=True)
    return {"host_device_bytes_per_step": moved / max(1, cur.step),"variant": v.name, "model": model, "opt": opt, "dp": dp, "scaler": scaler,
            "curve": curve, "val_loss": curve[-1][1], "steps": cur.step, "tokens": cur.tokens,
            "sent": sent, "expected": expected, "losses": losses, "seqlens": seqlens,
            "step_time_s": float(np.median(times[1:] if len(times) > 1 else times))}


def curve_plot(rows, width=64, height=14):
    """Validation loss against tokens, one letter per variant, as lines of text."""
    pts = [(r["variant"], t, l) for r in rows for t, l in r["curve"]]
    if not pts:
        return []
    t_max = max(t for _, t, _ in pts)
    lo, hi = min(l for *_, l in pts), max(l for *_, l in pts)
    hi = hi if hi > lo else lo + 1.0
    grid = [[" "] * width for _ in range(height)]
    marks = {}
    for i, r in enumerate(rows):
        marks[r["variant"]] = "abcdefghijklmnopqrstuvwxyz"[i]
    for name, t, l in pts:
        col = min(width - 1, int(round(t / t_max * (width - 1))))
        row = min(height - 1, int(round((hi - l) / (hi - lo) * (height - 1))))
        cell = grid[row][col]
        grid[row][col] = marks[name] if cell == " " else "*"
    out = [(f"  val loss  {hi:.3f} +" + "".join(grid[0])).rstrip()]
    out += [("            " + " " * 6 + "|" + "".join(g)).rstrip() for g in grid[1:-1]]
    out += [(f"            {lo:.3f} +" + "".join(grid[-1])).rstrip()]
    out.append("            " + " " * 6 + "+" + "-" * width)
    out.append("            " + " " * 6 + f"0{'tokens':^{width - 12}}{t_max:,}")
    legend = [f"{marks[r['variant']]} = {r['variant']}" for r in rows] + ["* = several"]
    for i in range(0, len(legend), 5):
        out.append("  " + "   ".join(legend[i:i + 5]))
    return out


def png_plot(rows, path):
    """Write the curves to `path` as a PNG (matplotlib, the optional `plot` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot([t for t, _ in r["curve"]], [l for _, l in r["curve"]], marker=".", label=r["variant"])
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("Lesson 10: the same tokens under each variant")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
