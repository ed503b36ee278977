"""Lesson 03: tensor parallelism. Every weight matrix of the GPT is cut across the ranks of
a tensor-parallel group (Megatron-LM); the run must equal one process training the whole model.

    mpirun -n 8 python -m minidist.lessons.03_tensor_parallel
    mpirun -n 4 python -m minidist.lessons.03_tensor_parallel --sequence-parallel
    mpirun -n 4 python -m minidist.lessons.03_tensor_parallel --sequence-parallel --sp-keep-gathered
    mpirun -n 8 python -m minidist.lessons.03_tensor_parallel --tp 4 --dropout 0.1
    mpirun -n 8 python -m minidist.lessons.03_tensor_parallel --generate 32
    mpirun -n 2 python -m minidist.lessons.03_tensor_parallel --dtype float32 --json out.json

Every rank builds the same single-process GPT from the seed and keeps its shards
(minidist/parallel/tp_model.py; the layers are in tensor_parallel.py); with --tp smaller
than the world, the other factor is data parallelism (ProcessGrid, tp fastest). It
trains a few AdamW steps with clipping by the global norm, gathers the shards back
under the single-process names, and compares the losses, the raw gradients of every
step and the weights with one process; then it prints the bytes each rank sent and the
memory each rank holds (weights; activations of one layer with and without sequence
parallelism) beside their formulas. Sequence parallelism runs as Megatron's does: c_attn
and c_fc keep their rank's slice of the sequence and gather it again in backward (2 more
all-gathers per layer, every activation cut by t); --sp-keep-gathered keeps the gathered
input instead, and sends the same bytes as plain TP. --generate N then decodes N tokens greedily with
the sharded model and a KV cache, and with the single-process model, and compares.
"""
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from minidist.comm import ProcessGrid, stats
from minidist.data import shard_slice
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.lessons.tp_report import activation_table, generation_report
from minidist.model import GPT
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.tensor_parallel import padded_vocab, vocab_range
from minidist.parallel.tp_formulas import expected_bytes
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync, gather
from minidist.plan.collectives import ring_all_reduce_bytes
from minidist.plan.memory import tp_weight_bytes
from minidist.plan.traffic import tp_layer_elements
from minidist.tensor import MEMORY
from minidist.train import TrainConfig


def check_input(args, cfg, world):
    """Every rank finds the same answer: bad input ends the job with one message, exit 2."""
    tp = args.tp or world
    if not (tp <= world and world % tp == 0):
        fit = max(d for d in range(1, world + 1) if world % d == 0 and d <= tp)
        works = harness.command_with(world, {"--tp": fit, **harness.heads_fix(cfg.n_head, cfg.n_embd, fit)})
        raise harness.InputError(f"--tp {tp} must divide the {world} ranks of the world (the rest is data "
                                 f"parallelism); this works: {works}")
    fix = harness.heads_fix(cfg.n_head, cfg.n_embd, tp)
    harness.need(cfg.n_head % tp == 0,
                 f"--n-head {cfg.n_head} is not divisible by the tensor-parallel size {tp}: each rank takes "
                 f"whole heads, each head n_embd / n_head channels; this works: {harness.command_with(world, fix)}")
    try:
        rows = shard_slice(args.batch_size, 0, world // tp)
    except ValueError as e:
        raise harness.InputError(f"--batch-size {args.batch_size} over {world // tp} data-parallel groups: {e}")
    harness.need(args.lr > 0, f"--lr must be positive, got {args.lr}")
    harness.need(args.sequence_parallel or not args.sp_keep_gathered,
                 "--sp-keep-gathered chooses a variant of sequence parallelism: add --sequence-parallel")
    return tp, rows.stop - rows.start


def layer_picture(model, cfg):
    """Which rank holds which columns, rows, heads and vocabulary (layer 0)."""
    t, C = model.tp, cfg.n_embd
    hs, nh = C // cfg.n_head, cfg.n_head // t
    rows = []
    for r in range(t):
        lo, hi = vocab_range(cfg.vocab_size, t, r)
        rows.append([f"rank {r}", f"head {r}" if nh == 1 else f"heads {r * nh}-{(r + 1) * nh - 1}",
                     f"q,k,v cols {r * nh * hs}:{(r + 1) * nh * hs}", f"rows {r * nh * hs}:{(r + 1) * nh * hs}",
                     f"cols {r * 4 * C // t}:{(r + 1) * 4 * C // t}", f"rows {r * 4 * C // t}:{(r + 1) * 4 * C // t}",
                     f"ids {lo}:{min(hi, cfg.vocab_size)}" + (f" +{hi - max(lo, cfg.vocab_size)} pad"
                                                             if hi > cfg.vocab_size else "")])
    harness.table([r[:4] for r in rows], header=["tp rank", "attention", "c_attn (col)", "attn.c_proj (row)"])
    say("")
    harness.table([r[:1] + r[4:] for r in rows], header=["tp rank", "mlp.c_fc (col)", "mlp.c_proj (row)",
                                                         "wte / head"])
    say("  replicated on every rank: ln_1, ln_2, ln_f, wpe, and the c_proj biases (added once, after the sum)")


def collectives_table(model, cfg, b, sp, clip):
    """The collectives of one micro-batch (and one step) in words, with elements per call."""
    T, C, t = cfg.block_size, cfg.n_embd, model.tp
    bsh = f"b*s*h = {b}*{T}*{C} = {b * T * C:,}"
    pair = ("in: all-gather forward (reduce-scatter backward); out: reduce-scatter forward (all-gather backward)"
            if sp else "in: f, nothing forward (all-reduce backward); out: g, all-reduce forward (nothing backward)")
    rows = [["each layer, attention", pair, bsh],
            ["each layer, MLP", "the same pair", bsh],
            ["token embedding", f"{'reduce-scatter' if sp else 'all-reduce'} forward "
                                f"({'all-gather' if sp else 'nothing'} backward)", bsh],
            ["head (tied wte)", f"{'all-gather' if sp else 'nothing'} forward, "
                                f"{'reduce-scatter' if sp else 'all-reduce'} backward", bsh],
            ["vocab-parallel loss", "all-reduce of the max, the target logit, the sum of exp", f"b*s = {b * T:,} each"]]
    regather = sp and not model.sp_keep_gathered
    if regather:                          # before the loss: per layer, as the rows above
        rows.insert(2, ["each layer, backward", "c_attn, c_fc: all-gather again the input slice they kept; "
                                                "for the weight gradient (the re-gather)", bsh])
    if sp:
        rows.append(["replicated gradients", "one all-reduce per step (layer norms, biases, wpe)",
                     f"{sum(p.size for n, p in model.named_parameters() if n not in model.specs):,}"])
    if clip:
        rows.append(["gradient clipping", "one all-reduce per step of the shards' squared norm", "1 (float64)"])
    say(f"  {'where':<22}  what, and the elements per call")    # stacked: too wide for one row each
    say(f"  {'-' * 22}  {'-' * 50}")
    for where, what, elements in rows:
        for i, part in enumerate(what.split("; ") + [f"elements per call: {elements}"]):
            say(f"  {where if i == 0 else '':<22}  {part}")
    per_layer = ("2 all-gathers + 2 reduce-scatters forward, 2 + 2 backward and 2 re-gathers" if regather else
                 "2 all-gathers + 2 reduce-scatters forward, the same backward" if sp else
                 "2 all-reduces forward + 2 backward")
    n, per_rank = 10 if regather else 8, tp_layer_elements(b, T, C, t, regather)
    say(f"  per transformer layer: {per_layer}:\n"
        f"  {n} b*s*h (t-1)/t = {per_rank:,} elements sent per rank "
        "(docs/reference.md#tensor-parallelism)")


def other_variant(model, b, T, got, clip, grid):
    """The all-gathers the other SP variant would send, by formula: the trade in bytes."""
    keep = model.sp_keep_gathered
    model.sp_keep_gathered = not keep                  # the formula reads the flag; the layers are built
    calls, other = expected_bytes(model, b, T, clip=clip, dp_comm=grid.dp_comm)["all_gather"]
    model.sp_keep_gathered = keep
    name = "with the re-gather (no --sp-keep-gathered)" if keep else "kept gathered (--sp-keep-gathered)"
    say(f"  the other variant, by formula: {name}, {calls} all-gathers, {other:,} B;\n"
        f"  the re-gather sends 2 b*s*h (t-1)/t elements more per layer ({abs(other - got['all_gather']):,} B "
        "in all here),\n  and each rank keeps 2 b*s*h (t-1)/t fewer per layer (the activation table below)")


def gather_all(model, state):
    """Whole arrays under the single-process names (every TP rank, same order)."""
    out = {}
    for key in sorted(state):
        name = key.split(":", 1)[1].split("@step")[0]
        out[key] = gather(model.comm, state[key], model.specs.get(name))
    return out


# ------------------------------------------------------------------------------------- 1. the setup

def setup(args):
    """The input checked, the grid built, the run described: the lesson's state, which the
    sections below read and add to."""
    comm = harness.comm_world()
    world = comm.Get_size()
    cfg = common.config_from_args(args, world)
    tp, per_dp = check_input(args, cfg, world)
    data = common.load_dataset(args, comm)
    grid = ProcessGrid(tp=tp, comm=comm)
    sp = args.sequence_parallel
    say(f"Lesson 03: tensor parallelism, tp={tp}" + (f" x dp={grid.dp}" if grid.dp > 1 else "")
        + f" on {world} ranks" + (", sequence parallel" if sp else "")
        + (" keeping the gathered inputs" if args.sp_keep_gathered else "") + "\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"vocab={cfg.vocab_size}" + (f" (padded to {padded_vocab(cfg.vocab_size, tp)})"
                                     if padded_vocab(cfg.vocab_size, tp) != cfg.vocab_size else "")
        + f" dropout={cfg.dropout} {cfg.dtype}")
    say(f"batch   global {args.batch_size} sequences" + (f" = {grid.dp} replicas x {per_dp}" if grid.dp > 1 else ""))
    say(f"steps   {args.steps} AdamW steps, " + (f"clipping at global norm {args.grad_clip}" if args.grad_clip
                                                  else "no clipping") + "\n")
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    return SimpleNamespace(args=args, comm=comm, cfg=cfg, tp=tp, per_dp=per_dp, data=data, grid=grid, sp=sp,
                           tc=tc)


# ----------------------------------------------------------------------- 2. the run and one process

def tensor_parallel_run(run):
    """Every rank builds the whole GPT and keeps its shards (who holds what shown), then trains."""
    args, cfg, grid, tc = run.args, run.cfg, run.grid, run.tc
    run.model = model = TensorParallelGPT(GPT(cfg, seed=args.seed), grid.tp_comm, sequence_parallel=run.sp,
                                          sp_keep_gathered=args.sp_keep_gathered)
    say("who holds what (every layer alike)")
    layer_picture(model, cfg)
    dp = NaiveDataParallel(model, grid.dp_comm) if grid.dp > 1 else None
    run.opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    rows = shard_slice(args.batch_size, grid.dp_rank, grid.dp)
    MEMORY.reset_peak()
    with stats.measure() as run.meas:        # the sync slot also supplies the global norm for clipping
        losses, state, run.times = common.train_and_collect(model, run.opt, run.data, args, tc, rows, 1,
                                                            TensorParallelSync(model, dp))
    run.act_peak = MEMORY.peak_bytes
    run.losses = list(common.mpi_reduce(grid.dp_comm, losses, "sum") / grid.dp)
    run.state = gather_all(model, state)


def compare_section(run):
    """The reference: one process, the whole model and batch, against the shards gathered back."""
    args, cfg, comm, grid, tc, state = run.args, run.cfg, run.comm, run.grid, run.tc, run.state
    run.ref = ref = GPT(cfg, seed=args.seed)
    ref_opt = ref.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    run.ref_losses, ref_state, _ = common.train_and_collect(ref, ref_opt, run.data, args, tc)
    state["loss"], ref_state["loss"] = np.array(run.losses), np.array(run.ref_losses)
    rel, abs_diff, _ = harness.compare(state, ref_state)
    run.rel, run.abs_diff = common.mpi_reduce(comm, [rel, abs_diff])
    run.tol = harness.TOLERANCE[cfg.dtype]
    run.match = bool(run.rel <= run.tol)

    common.report_comparison(comm, f"tp={run.tp}" + (f" x dp={grid.dp}" if grid.dp > 1 else ""), run.ref_losses,
                             run.losses, state, ref_state, run.tol, show_where="",
                             notes=["shards gathered back to whole tensors, padding removed"])


# --------------------------------------------------------------------------------- 3. communication

def comm_section(run):
    """The collectives of one micro-batch, and the bytes each rank sent per step measured beside
    the formula (the largest over ranks)."""
    args, cfg, comm, grid, model, meas, tp, per_dp = (run.args, run.cfg, run.comm, run.grid, run.model, run.meas,
                                                      run.tp, run.per_dp)
    say(f"\ncollectives of one micro-batch of b={per_dp} sequences (s={cfg.block_size}, h={cfg.n_embd}, t={tp})")
    collectives_table(model, cfg, per_dp, run.sp, bool(args.grad_clip))
    want = expected_bytes(model, per_dp, cfg.block_size, clip=bool(args.grad_clip), dp_comm=grid.dp_comm)
    names = sorted(want)
    run.got = got = {n: int(common.mpi_reduce(comm, meas.bytes_sent(n) // args.steps)) for n in names}
    run.exp = exp = {n: int(common.mpi_reduce(comm, want[n][1])) for n in names}
    calls = {n: int(common.mpi_reduce(comm, meas.get(n, {}).get("calls", 0) // args.steps)) for n in names}
    say("\nbytes sent per rank per step" + (" (all-reduces include the data-parallel average)" if grid.dp > 1 else ""))
    harness.table([[n, calls[n], want[n][0], f"{got[n]:,}", f"{exp[n]:,}", "equal" if got[n] == exp[n] else "DIFFERENT"]
                   for n in names], header=["collective", "calls measured", "calls by formula", "bytes measured", "bytes by formula", "verdict"])
    run.bytes_ok = all(got[n] == exp[n] for n in names)
    if run.sp:
        other_variant(model, per_dp, cfg.block_size, got, bool(args.grad_clip), grid)
    logits = per_dp * cfg.block_size * padded_vocab(cfg.vocab_size, tp) * np.dtype(cfg.dtype).itemsize
    say(f"  never the logits: one all-reduce of the b*s*v logits would send "
        f"{fmt_bytes(ring_all_reduce_bytes(logits, tp))} alone")


# ------------------------------------------------------------------------------- 4. memory per rank

def memory_section(run):
    """Weights per rank beside 1/t of the sharded values plus the replicated ones; the
    activations, layer by layer, beside this engine's count."""
    cfg, comm, model, tp = run.cfg, run.comm, run.model, run.tp
    item = np.dtype(cfg.dtype).itemsize
    sharded = sum(int(np.prod(s)) for n, s in model.full_shapes.items() if n in model.specs)
    sharded += (padded_vocab(cfg.vocab_size, tp) - cfg.vocab_size) * cfg.n_embd
    replicated = sum(int(np.prod(s)) for n, s in model.full_shapes.items() if n not in model.specs)
    run.params = params = sum(p.data.nbytes for p in model.parameters())
    weights_formula = tp_weight_bytes(sharded, replicated, tp, item)
    say("\nmemory per rank")
    harness.table([["weights", fmt_bytes(params), f"{fmt_bytes(weights_formula)} = 1/{tp} of {sharded:,} sharded "
                    f"+ {replicated:,} replicated values"],
                   ["activations, whole step", fmt_bytes(common.mpi_reduce(comm, run.act_peak)),
                    "the layers below, the embedding, the head and the loss"],
                   ["  (peak saved)", "", ""]],
                  header=["", "measured", "formula"])
    run.act_ok, run.figures = activation_table(cfg, run.per_dp, run.grid.tp_comm, run.args.seed)


# ------------------------------------------------------------------------------- 5. greedy decoding

def generation_section(run):
    """With --generate: greedy decoding with a KV cache, sharded and in one process."""
    run.gen_ok = True
    if run.args.generate:
        run.gen_ok, gen_figures = generation_report(run.model, run.ref, run.data, run.args.generate, run.grid)
        run.figures.update(gen_figures)


# ------------------------------------------------------------------------------------ 6. the report

def report_section(run):
    """The step time, the figures and the verdict."""
    args, comm, model, act_peak = run.args, run.comm, run.model, run.act_peak
    step_time = common.mpi_reduce(comm, float(np.median(run.times)))
    say(f"\ntraining step: median {step_time * 1e3:.1f} ms (slowest rank)")
    mem = {"params": int(common.mpi_reduce(comm, run.params)),
           "grads": int(common.mpi_reduce(comm, sum(p.grad.nbytes for p in model.parameters() if p.grad is not None))),
           "optimizer": int(common.mpi_reduce(comm, run.opt.state_bytes())),
           "activations_peak": int(common.mpi_reduce(comm, act_peak))}
    report = harness.new_report(
        "03_tensor_parallel", args, parallel={"tp": run.tp, "dp": run.grid.dp, "pp": 1,
                                              "sequence_parallel": bool(run.sp)},
        match=bool(run.match and run.bytes_ok and run.act_ok and run.gen_ok), max_rel_diff=run.rel,
        max_abs_diff=run.abs_diff, tolerance=run.tol, losses={"reference": run.ref_losses, "parallel": run.losses},
        comm={"bytes_sent": run.got, "expected_bytes": run.exp}, memory=mem, step_time_s=step_time,
        figures=run.figures)
    say("\nthe verdict needs: losses, raw gradients and weights within the tolerance; bytes and activation\n"
        "bytes equal to their counts" + ("; the same generated tokens as one process" if args.generate else ""))
    if not run.bytes_ok:
        say("\nthe bytes measured differ from the formula: a collective too many, or one of the wrong size")
    if not run.act_ok:
        say("\nthe activation meter differs from this engine's count: a Function saves more (or less) than listed")
    if not run.gen_ok:
        say("\nthe tensor-parallel model generated other tokens than the single-process model")
    return report


def main(args):
    run = setup(args)
    tensor_parallel_run(run)
    compare_section(run)
    comm_section(run)
    memory_section(run)
    generation_section(run)
    return harness.finish(report_section(run), args)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=2, n_head=8, n_embd=64, block_size=32, batch_size=8)
    p.add_argument("--tp", type=harness.positive_int, help="tensor-parallel size (default: the world size)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="layer norms and dropout on a slice of the sequence (Korthikanti et al. 2022)")
    p.add_argument("--sp-keep-gathered", action="store_true",
                   help="with --sequence-parallel: c_attn and c_fc keep the gathered input for backward "
                        "(no re-gather: fewer bytes, more memory)")
    common.add_step_flags(p)
    p.add_argument("--generate", type=harness.nonnegative_int, default=0, metavar="N",
                   help="then decode N tokens greedily with a KV cache, sharded and in one process")
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
