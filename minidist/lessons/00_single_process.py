"""Lesson 00: one process trains a GPT. Every later lesson is checked against this run.

    python -m minidist.lessons.00_single_process
    python -m minidist.lessons.00_single_process --steps 300 --n-layer 6 --json out.json

One process only: started under mpirun on several ranks it says so once and every rank
exits 2 (eight identical copies would teach nothing and print everything eight times).

It trains nanoGPT's model on bytes of text (the Python standard library's source by
default, or --data FILE), printing loss, tokens/s and MFU per step, then a memory table
measured from the arrays the process holds beside the formula, then checks the engine's
gradients against central differences on a tiny float64 copy of the model (that check is
this lesson's `match`), and ends with a sample from the trained model. On a terminal one
more line updates under the table after every step: the step, its loss and the time left
(minidist.progress); in a log or a pipe the table's lines are all there is.

On a device (MINIDIST_DEVICE=cuda, or strict: the CPU double of one) the weights, the
activations and the optimizer's state never leave it; what crosses in a step is the token
ids in (with --dropout, the masks too: drawn on the host, sent as bits) and two numbers out
(the loss, the gradient's norm for clipping). The report counts those bytes (figures:
host_device_bytes_per_step, 0 on the CPU) and the last lines say what they cost over PCIe.
"""
import sys
import time

import numpy as np

from minidist import metrics, transfers
from minidist.backend import dtype_of, to_numpy
from minidist.data import decode, encode
from minidist.equivalence import host_device_bytes
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT, GPTConfig
from minidist.plan.memory import engine_state_bytes
from minidist.progress import WIDTH, Progress
from minidist.tensor import MEMORY
from minidist.train import TrainConfig, estimate_loss, get_lr, micro_batches, train_step

# Central differences in float64 with h = 1e-5: truncation is ~h^2 = 1e-10, and the
# rounding of a loss near 5 (~1e-15) divided by 2h leaves ~5e-11 of absolute error. The
# tiny model's smallest tensors have gradients near 5e-4, so the error relative to a
# tensor's largest gradient is about 1e-7 (measured over seeds 0-4: 4e-8 to 1e-7). A wrong
# backward is off by 1e-2 or more; the bound 1e-5 sits between with a margin of 100.
GRADCHECK_TOL = 1e-5


def gradient_check(seed, samples_per_param=3, h=1e-5):
    """Analytic gradients vs central differences on a tiny float64 GPT.

    For every parameter, a few elements chosen at random are nudged by +-h and the loss
    recomputed: (L(w+h) - L(w-h)) / 2h. The error of a tensor is the largest difference
    over its sampled elements divided by the largest |gradient| in the whole tensor.
    Returns (worst relative error, worst absolute error, name of the worst tensor, count).
    """
    cfg = GPTConfig(block_size=8, vocab_size=256, n_layer=2, n_head=2, n_embd=16, dropout=0.0, dtype="float64")
    model = GPT(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    ids = encode("def f(x):\n    return x * 2\n")
    starts = rng.integers(0, len(ids) - cfg.block_size - 1, size=2)
    x = np.stack([ids[s:s + cfg.block_size] for s in starts]).astype(np.int64)
    y = np.stack([ids[s + 1:s + cfg.block_size + 1] for s in starts]).astype(np.int64)
    model.zero_grad()
    model(x, y)[1].backward()
    worst, worst_abs, worst_name, n_checked = 0.0, 0.0, None, 0
    for name, p in model.named_parameters():
        grad = to_numpy(p.grad)
        errs = []
        for i in rng.choice(grad.size, size=min(samples_per_param, grad.size), replace=False):
            at = np.unravel_index(i, grad.shape)
            old = float(p.data[at])
            p.data[at] = old + h
            plus = model(x, y)[1].item()
            p.data[at] = old - h
            minus = model(x, y)[1].item()
            p.data[at] = old
            errs.append(abs((plus - minus) / (2 * h) - grad[at]))
            n_checked += 1
        scale = float(np.max(np.abs(grad))) or 1.0
        rel = max(errs) / scale
        if rel >= worst:
            worst, worst_abs, worst_name = rel, max(errs), name
    return worst, worst_abs, worst_name, n_checked


def main(args):
    harness.single_process("lesson 00")
    cfg = common.config_from_args(args)
    data = common.load_dataset(args)
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=min(20, args.steps // 10), seed=args.seed,
                     eval_interval=args.eval_interval)
    model = GPT(cfg, seed=args.seed)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    n_params = model.get_num_params()  # without the position table, as nanoGPT counts
    fpt = metrics.flops_per_token(cfg, n_params)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else metrics.measure_peak_flops(cfg.dtype)
    tokens = args.batch_size * cfg.block_size

    say("Lesson 00: one process trains a GPT (the reference every later lesson is checked against)\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"vocab={cfg.vocab_size} dropout={cfg.dropout} {cfg.dtype}")
    say(f"        N = {n_params:,} parameters (all but the position table; lm_head shares wte)")
    n_train, n_val = (len(data.splits[s]) for s in ("train", "val"))
    say(f"data    {'default corpus (Python stdlib source)' if args.data is None else args.data}: "
        f"{n_train:,} train / {n_val:,} val byte tokens")
    say(f"batch   {args.batch_size} sequences x {cfg.block_size} tokens = {tokens:,} tokens per step")
    say(f"FLOPs   6N + 12*L*H*Q*T with L={cfg.n_layer} layers, H={cfg.n_head} heads of Q={cfg.n_embd // cfg.n_head}, "
        f"T={cfg.block_size} tokens")
    say(f"        = {fpt / 1e6:.2f} MFLOP per token; peak "
        f"{'given' if args.peak_tflops else 'measured'} {peak / 1e9:.1f} GFLOP/s "
        f"({cfg.dtype} matmul, OMP_NUM_THREADS={harness.env_threads()})\n")

    say(f"{'step':>5}  {'loss':>7}  {'lr':>8}  {'ms':>7}  {'tok/s':>8}  {'MFU':>6}")
    losses, times, moved = [], [], 0
    bar = Progress(args.steps, "training", every=args.steps) if _terminal() else None

    def row(text):
        """A line of the table: on a terminal, written over the progress line, which the
        next update draws again below it."""
        if bar is not None and bar.open:
            sys.stdout.write("\r" + " " * (WIDTH - 1) + "\r")
            bar.open = False
        say(text)

    for step in range(args.steps):
        x, y = data.get_batch("train", args.batch_size, step)
        MEMORY.reset_peak()
        before = transfers.snapshot()           # on a device: the token ids in, the loss out
        t0 = time.perf_counter()
        loss, _ = train_step(model, opt, micro_batches(x, y, step, args.seed), get_lr(step, tc), tc.grad_clip)
        dt = time.perf_counter() - t0
        moved += host_device_bytes(before)
        losses.append(loss)
        times.append(dt)
        if step % args.log_interval == 0 or step == args.steps - 1:
            row(f"{step:>5}  {loss:7.4f}  {get_lr(step, tc):8.2e}  {dt * 1e3:7.1f}  {tokens / dt:8,.0f}  "
                f"{metrics.mfu(tokens / dt, fpt, peak):6.1%}")
        if args.eval_interval and (step + 1) % args.eval_interval == 0:
            ev = estimate_loss(model, data, args.batch_size, tc.eval_iters)
            row(f"{'':>5}  validation: train loss {ev['train']:.4f}, val loss {ev['val']:.4f}")
        if bar is not None:
            bar.update(step + 1, f"step {step} loss {loss:.4f}")
    step_time = float(np.median(times[1:] if len(times) > 1 else times))
    say(f"\nloss fell from {losses[0]:.4f} to {losses[-1]:.4f}; median step {step_time * 1e3:.1f} ms, "
        f"{tokens / step_time:,.0f} tokens/s, MFU {metrics.mfu(tokens / step_time, fpt, peak):.1%}")

    mem = metrics.memory_by_category(model.parameters(), opt, MEMORY.peak_bytes)
    n_all = sum(p.data.size for p in model.parameters())
    b = np.dtype(dtype_of(cfg.dtype)).itemsize
    want = engine_state_bytes(0, n_all, 1, b)          # one process: plain AdamW, nothing sharded
    say(f"\nmemory of this process, measured from the arrays it holds; P = {n_all:,} parameters, all of them")
    say(f"(N above leaves out the position table), {b} bytes each:")
    harness.table([
        ["params", fmt_bytes(mem["params"]), fmt_bytes(want["params"]), f"{b} B x P"],
        ["grads", fmt_bytes(mem["grads"]), fmt_bytes(want["grads"]), f"{b} B x P"],
        ["optimizer (AdamW m, v)", fmt_bytes(mem["optimizer"]), fmt_bytes(want["optimizer"]), f"2 x {b} B x P"],
        ["total before activations", fmt_bytes(mem["params"] + mem["grads"] + mem["optimizer"]),
         fmt_bytes(sum(want.values())), f"{4 * b} B x P"],
        ["activations (peak saved for backward)", fmt_bytes(mem["activations_peak"]), "", "grows with B x T"],
    ], header=["category", "measured", "formula", ""])

    rel, abs_err, worst_name, n_checked = gradient_check(args.seed)
    ok = rel <= GRADCHECK_TOL
    say(f"\ngradient check: backward() vs central differences, float64, tiny GPT (n_layer=2, n_embd=16)")
    say(f"  {n_checked} elements, 3 drawn from each parameter tensor; the worst, in {worst_name},")
    say(f"  is off by {rel:.2e} of that tensor's largest gradient (bound {GRADCHECK_TOL:.0e}) -> {'PASS' if ok else 'FAIL'}")

    if args.sample_tokens:
        start = encode("def ")[None, :].astype(np.int64)
        out = model.generate(start, args.sample_tokens, temperature=0.8, top_k=40,
                             rng=np.random.default_rng(args.seed))
        say(f"\nsample ({args.sample_tokens} tokens, temperature 0.8, top_k 40):\n" + "-" * 60)
        say(decode(to_numpy(out)[0]))
        say("-" * 60)

    report = harness.new_report(
        "00_single_process", args, parallel={"dp": 1, "tp": 1, "pp": 1}, match=ok, max_rel_diff=rel,
        max_abs_diff=abs_err, tolerance=GRADCHECK_TOL, losses={"reference": losses, "parallel": None},
        memory=mem, step_time_s=step_time, mfu=metrics.mfu(tokens / step_time, fpt, peak),
        figures={"host_device_bytes_per_step": moved / args.steps})
    return harness.finish(report, args)


def _terminal():
    """Whether this lesson's lines go to a terminal (not a file, a pipe, or a test's capture)."""
    return sys.stdout.isatty() and harness.captured() is None


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=150, dtype="float32")
    common.add_model_flags(p, n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16)
    p.add_argument("--lr", type=harness.positive_float, default=2e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--eval-interval", type=harness.nonnegative_int, default=50,
                   help="steps between validation losses (0: never)")
    p.add_argument("--log-interval", type=harness.positive_int, default=10, help="steps between printed lines")
    p.add_argument("--sample-tokens", type=harness.nonnegative_int, default=200,
                   help="length of the closing sample (0: none)")
    p.add_argument("--peak-tflops", type=harness.positive_float, help="peak TFLOP/s for MFU instead of measuring it")
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
