"""Lesson 13: long context. Blockwise attention keeps no s x s array; context parallelism cuts
the sequence across ranks, attention included; the run must equal one process.

Over 400 lines but one story: main calls named sections in order (the work per rank, bytes
beside the formula, memory, overlap, attention's timing); the strategy lives in
minidist/parallel/context_parallel.py and cp_model.py.

    mpirun -n 4 python -m minidist.lessons.13_context_parallel
    mpirun -n 4 python -m minidist.lessons.13_context_parallel --variant ulysses
    mpirun -n 4 python -m minidist.lessons.13_context_parallel --variant allgather
    mpirun -n 4 python -m minidist.lessons.13_context_parallel --no-load-balance
    mpirun -n 3 python -m minidist.lessons.13_context_parallel --seq 250
    mpirun -n 8 python -m minidist.lessons.13_context_parallel --cp 2 --tp 2
    mpirun -n 4 python -m minidist.lessons.13_context_parallel --dropout 0.1 --json out.json

Every rank builds the same single-process GPT (blockwise attention, minidist/attention.py)
and ContextParallelGPT (minidist/parallel/cp_model.py) keeps this rank's chunks of
every sequence: 2 cp chunks, rank r holding r and 2cp-1-r (Megatron-LM's load balance) or,
with --no-load-balance, 2r and 2r+1. Attention gets the other ranks' keys and values by
--variant: ring (ring attention, Liu et al. 2023; "pass-KV" in Yang et al. 2024: K, V
travel the ring, partial results merged by log-sum-exp, dK, dV travel back; the messages
overlap the compute unless --no-overlap), ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023:
all-to-all from tokens to heads and back) or allgather (the forward Llama 3 describes,
Grattafiori et al. 2024, section 3.3.2: all-gather K, V; the backward, gather again and
reduce-scatter dK, dV, is Transformer Engine's all-gather CP, not the paper's). The weight
gradients are averaged over the data-parallel x context-parallel ranks (Megatron-LM's
way); with --tp the model is lesson 03's TensorParallelGPT, its heads split first.

It trains a few AdamW steps, compares the losses, raw gradients and weights with one
process training the whole sequence, and prints: the score tiles each rank computed
(minidist.attention.STATS) with this split and the other, beside plan/context.py; the
bytes each rank sent beside cp_sent (exact) and the papers' formula, the other variants
and GQA by formula; the activation meter's peak per rank beside one process's / cp, and
one layer's saves over s = 512 .. 8192 (plain, blockwise, blockwise + CP); the ring's
wait with and without overlap; blockwise against plain attention's step time.
"""
import time

import numpy as np

from minidist.attention import STATS
from minidist.comm import ProcessGrid
from minidist.data import shard_slice
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.parallel.cp_model import ContextParallelGPT
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync, gather
from minidist.plan import context as plan_cp
from minidist.plan.memory import engine_layer_saves
from minidist.tensor import MEMORY
from minidist.train import TrainConfig

VARIANTS = plan_cp.VARIANTS
NAMES = {"ring": "ring (pass-KV)", "ulysses": "Ulysses (all-to-all)", "allgather": "all-gather K, V"}
GQA = 8                      # the KV-head reduction of the GQA line (Llama 3: 128 heads, 8 KV heads)


# ----------------------------------------------------------------------------- flags and input

def check_input(args, cfg, world):
    """Every rank finds the same answer: bad input ends the job with one message, exit 2,
    and a command that works."""
    ok = harness.command_with
    harness.need(args.variant in VARIANTS,
                 f"--variant {args.variant!r} is not one of {', '.join(VARIANTS)}; this works: "
                 f"{ok(world, {'--variant': 'ring'})}")
    tp = args.tp or 1
    if not (tp <= world and world % tp == 0):
        fit = max(d for d in range(1, world + 1) if world % d == 0 and d <= tp)
        raise harness.InputError(f"--tp {tp} must divide the {world} ranks of the world; this works: "
                                 f"{ok(world, {'--tp': fit, **harness.heads_fix(cfg.n_head, cfg.n_embd, fit)})}")
    cp = args.cp or world // tp
    if world % (cp * tp):
        fit = max(d for d in range(1, world // tp + 1) if (world // tp) % d == 0 and d <= cp)
        raise harness.InputError(f"--cp {cp} x --tp {tp} = {cp * tp} ranks per sequence does not divide the "
                                 f"{world} ranks of the world (dp = world / (cp x tp)); this works: "
                                 f"{ok(world, {'--cp': fit})}")
    fix = harness.heads_fix(cfg.n_head, cfg.n_embd, tp)
    harness.need(cfg.n_head % tp == 0,
                 f"--n-head {cfg.n_head} is not divisible by the tensor-parallel size {tp}: each rank takes "
                 f"whole heads; this works: {ok(world, fix)}")
    if args.variant == "ulysses":
        fix = harness.heads_fix(cfg.n_head, cfg.n_embd, tp * cp)
        harness.need((cfg.n_head // tp) % cp == 0,
                     f"Ulysses gives each of the cp={cp} ranks whole heads: the {cfg.n_head // tp} heads of "
                     f"{'a tensor-parallel rank' if tp > 1 else 'the model'} do not divide by {cp}; this works: "
                     f"{ok(world, fix)} (or --variant ring)")
    harness.need(cfg.block_size >= 2 * cp,
                 f"--seq {cfg.block_size} is cut into 2 x cp = {2 * cp} chunks: it needs at least {2 * cp} "
                 f"tokens; this works: {ok(world, {'--seq': max(256, 2 * cp)})}")
    dp = world // (cp * tp)
    try:
        rows = shard_slice(args.batch_size, 0, dp)
    except ValueError as e:
        works = ok(world, {"--batch-size": -(-args.batch_size // dp) * dp})
        raise harness.InputError(f"--batch-size {args.batch_size} over {dp} data-parallel replicas: {e}; "
                                 f"this works: {works}")
    return tp, cp, dp, rows.stop - rows.start


def config(args, world):
    """GPTConfig from the flags, blockwise attention; a head count that leaves a head without
    whole channels is refused with flags that also give each tensor-parallel rank whole heads."""
    tp = args.tp if args.tp and world % args.tp == 0 else 1
    fix = harness.heads_fix(args.n_head, args.n_embd, tp)
    harness.need(args.n_embd % args.n_head == 0,
                 f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}: each head gets "
                 f"n_embd / n_head channels; this works: {harness.command_with(world, fix)}")
    cfg = common.config_from_args(args, world)
    cfg.attention, cfg.attn_block = "blockwise", args.attn_block
    return cfg


# ----------------------------------------------------------------------------- building the runs

def build_cp(cfg, args, grid, variant, load_balance, overlap=True):
    """The context-parallel model on this rank and the training step's dp slot for it: the
    weight gradients averaged over the dp x cp ranks (with TP, inside TensorParallelSync)."""
    full = GPT(cfg, seed=args.seed)
    if grid.tp > 1:
        full = TensorParallelGPT(full, grid.tp_comm)
    model = ContextParallelGPT(full, grid, variant=variant, load_balance=load_balance, overlap=overlap)
    dp = NaiveDataParallel(model, grid.dp_cp_comm)
    return model, (TensorParallelSync(full, dp) if grid.tp > 1 else dp)


def zero_grad(model):
    for p in model.parameters():
        p.grad = None


def gather_all(model, state, grid):
    """Whole arrays under the single-process names (tensor-parallel shards gathered)."""
    if grid.tp == 1:
        return state
    specs = model.model.specs
    return {key: gather(grid.tp_comm, state[key], specs.get(key.split(":", 1)[1].split("@step")[0]))
            for key in sorted(state)}


def per_rank(comm, value):
    """[value of rank 0, value of rank 1, ...] on every rank (MPI's own all-reduce, uncounted)."""
    one = [0.0] * comm.Get_size()
    one[comm.Get_rank()] = float(value)
    return [v for v in common.mpi_reduce(comm, one, "sum")]


def step_batches(data, args, rows, step=0):
    from minidist.train import micro_batches
    x, y = data.get_batch("train", args.batch_size, step)
    return micro_batches(x[rows], y[rows], step, args.seed, 1, first_sample=rows.start or 0)


def one_step_work(model, data, args, rows):
    """STATS of one forward and backward of step 0's batch (no optimizer step)."""
    STATS.reset()
    for x, y, rng in step_batches(data, args, rows):
        _, loss = model(x, y, rng=rng)
        loss.backward()
    zero_grad(model)
    return STATS.tiles_forward, STATS.tiles_backward, STATS.scores_forward, STATS.scores_backward


# ----------------------------------------------------------------------------- the report's parts

def layout_picture(seq, cp, load_balance):
    lengths = plan_cp.chunk_lengths(seq, cp)
    even = len(set(lengths)) == 1
    say(f"who holds which tokens: {2 * cp} chunks of " + (f"{lengths[0]} tokens" if even else
        f"{lengths[0]} or {lengths[-1]} tokens (the first {seq % (2 * cp)} one longer)")
        + (";\nrank r holds chunks r and 2cp-1-r" if load_balance else ";\nrank r holds chunks 2r and 2r+1"))
    rows = []
    for r in range(cp):
        ch = plan_cp.chunks_of(r, cp, load_balance)
        spans = [plan_cp.chunk_range(seq, cp, c) for c in ch]
        rows.append([f"cp rank {r}", ", ".join(map(str, ch)), ", ".join(f"{lo}-{hi - 1}" for lo, hi in spans),
                     sum(hi - lo for lo, hi in spans)])
    harness.table(rows, header=["", "chunks", "positions", "tokens"])


def work_section(comm, grid, cfg, args, variant, lb, measured, other, steps):
    """Tiles and score elements per rank, this split (measured in training) and the other
    (one forward and backward), beside plan/context.py. Returns (ok, figures)."""
    L, cp, seq, blk = cfg.n_layer, grid.cp, cfg.block_size, cfg.attn_block
    heads = cfg.n_head // grid.tp
    b = args.batch_size // grid.dp
    ranks_cp = [grid.cp_rank_of(r) for r in range(comm.Get_size())]
    ok, figures, rows = True, {}, []
    for split, lb_, (tf, tb, sf, sb), per in (("zigzag" if lb else "naive", lb, measured, steps),
                                              ("naive" if lb else "zigzag", not lb, other, 1)):
        tiles = [v / (per * L) for v in per_rank(comm, tf)]                  # one attention forward
        tiles_b = [v / (per * L) for v in per_rank(comm, tb)]
        scores = [v / (per * L) for v in per_rank(comm, sf)]
        want_t = [plan_cp.attention_tiles(variant, seq, cp, c, blk, lb_) for c in ranks_cp]
        want_s = [plan_cp.attention_scores(variant, b, seq, heads, cp, c, lb_) for c in ranks_cp]
        same = tiles == want_t and tiles_b == want_t and scores == want_s
        ok &= same
        key = "balanced" if lb_ else "naive"
        figures[f"attention_tiles_per_rank_{key}"] = [int(v) for v in tiles]
        figures[f"attention_tiles_formula_{key}"] = want_t
        figures[f"attention_scores_per_rank_{key}"] = [int(v) for v in scores]
        figures[f"attention_scores_formula_{key}"] = want_s
        if split == ("zigzag" if lb else "naive"):
            figures["attention_blocks_per_rank"] = [int(v) for v in tiles]
        spread_t = plan_cp.imbalance(tiles)[0]
        ratio_s = plan_cp.imbalance(scores)[1]
        figures[f"attention_scores_busiest_over_idlest_{key}"] = ratio_s
        for r in grid.cp_group(0):
            rows.append([split if r == grid.cp_group(0)[0] else "", ranks_cp[r], f"{int(tiles[r])}",
                         f"{want_t[r]}", f"{int(scores[r]):,}", f"{want_s[r]:,}",
                         "equal" if (tiles[r], tiles_b[r], scores[r]) == (want_t[r], want_t[r], want_s[r])
                         else "DIFFERENT"])
        rows.append(["", "", f"+{int(spread_t)}", "", f"{ratio_s:.2f} : 1", "", "busiest vs idlest"])
    what = (f"the whole sequence on {heads // cp} head{'s' if heads // cp > 1 else ''} per rank, in tiles of "
            f"{blk} x {blk}" if variant == "ulysses" else
            f"each of my chunks against each chunk, in tiles of at most {blk} x {blk}")
    say(f"\nattention work per rank in one layer's forward (the backward recomputes as many):\n{what};\n"
        f"measured by minidist.attention.STATS beside plan/context.py; the split you chose was\ntrained, "
        f"the other ran one forward and backward"
        + ("" if comm.Get_size() == cp else "; the cp group of rank 0 shown, every rank checked"))
    harness.table(rows, header=["split", "cp rank", "tiles", "formula", "score elements", "formula", ""])
    if variant != "ulysses" and cp > 1:
        lengths = sorted(set(plan_cp.chunk_lengths(seq, cp)), reverse=True)
        spans = sorted({-(-n // blk) for n in lengths}, reverse=True)       # tiles a chunk spans
        if len(spans) == 1:
            say(f"  zigzag: every rank's chunks see 2cp-1 = {2 * cp - 1} earlier chunks and every chunk spans "
                f"{spans[0]} tile{'s' if spans[0] > 1 else ''},\n  so every rank computes the same tiles")
        else:
            say(f"  zigzag: the chunks are {lengths[0]} and {lengths[1]} tokens, {spans[0]} and {spans[1]} tiles "
                f"of {blk}: the tile counts\n  differ (they are equal when every chunk spans as many tiles, e.g. "
                f"when --attn-block divides\n  s/2cp); the score elements stay balanced to within the uneven token")
        say(f"  naive: rank r's chunks see 4r+1 earlier chunks, so the last does about 2cp-1 = {2 * cp - 1} times\n"
            f"  the first's score elements")
    elif variant == "ulysses":
        say("  Ulysses attends the whole sequence on each rank's heads: no causal imbalance to remove")
    return ok, figures


def bytes_section(comm, grid, cfg, args, variant, lb, sent_per_step):
    """Bytes per rank per step of the attention exchange, beside cp_sent and the papers'."""
    L, cp, seq = cfg.n_layer, grid.cp, cfg.block_size
    heads, hd = cfg.n_head // grid.tp, cfg.n_embd // cfg.n_head
    b, item = args.batch_size // grid.dp, np.dtype(cfg.dtype).itemsize
    measured = per_rank(comm, sent_per_step)
    ranks_cp = [grid.cp_rank_of(r) for r in range(comm.Get_size())]
    exact = [L * plan_cp.cp_sent(variant, b, seq, heads, hd, cp, c, item, lb) for c in ranks_cp]
    paper = L * plan_cp.cp_layer_bytes(variant, b, seq, heads, hd, cp, item)
    ok = all(int(m) == e for m, e in zip(measured, exact))
    say(f"\nbytes each rank sent per step for attention, {NAMES[variant]}: b={b} s={seq} a={heads} "
        f"a_kv={heads} hs={hd},\n{L} layers, {cfg.dtype}" + (" (a, a_kv: one tensor-parallel rank's heads)"
                                                           if grid.tp > 1 else "")
        + "; the gradient all-reduce is not in it"
        + ("" if comm.Get_size() == cp else "\n(the cp group of rank 0 shown, every rank checked)"))
    rows = [[f"cp rank {ranks_cp[r]}" + (f" (rank {r})" if comm.Get_size() > cp else ""), f"{int(measured[r]):,}",
             f"{exact[r]:,}", "equal" if int(measured[r]) == exact[r] else "DIFFERENT"]
            for r in grid.cp_group(0)]
    harness.table(rows, header=["", "measured", "cp_sent (exact)", ""])
    n = f"{seq // cp}" if seq % cp == 0 else f"{seq}/{cp}"
    formula = {"ring": "6 (cp-1) b n a_kv hs", "ulysses": "4 (a + a_kv) (cp-1)/cp b n hs",
               "allgather": "6 (cp-1) b n a_kv hs"}
    say(f"  the papers' formula, n = s/cp = {n}: {formula[variant]} x {item} B x {L} layers = {paper:,.0f} B"
        + ("" if all(e == paper for e in exact) else "\n  (cp_sent differs: the chunks are uneven, and the "
                                                      "formula assumes s/cp tokens on every rank)"))
    say("  per rank per step, by formula: "
        + ", ".join(f"{v} {fmt_bytes(L * plan_cp.cp_layer_bytes(v, b, seq, heads, hd, cp, item))}"
                    for v in VARIANTS))
    kv = heads / GQA
    say(f"  with GQA, a_kv = a/{GQA} key/value heads (Llama 3: 8 for 128 heads), by formula:\n    "
        + ", ".join(f"{v} {fmt_bytes(L * plan_cp.cp_layer_bytes(v, b, seq, heads, hd, cp, item, kv))}"
                    for v in VARIANTS)
        + "\n  (ring and all-gather move K, V only: they shrink with the KV heads; Ulysses moves q and o too)")
    figures = {"cp_bytes_measured": int(max(measured)), "cp_bytes_formula": int(max(exact)),
               "cp_bytes_paper_formula": paper, "cp_bytes_measured_per_rank": [int(v) for v in measured],
               "cp_bytes_formula_per_rank": exact}
    for v in VARIANTS:
        figures[f"cp_bytes_paper_{v}"] = L * plan_cp.cp_layer_bytes(v, b, seq, heads, hd, cp, item)
        figures[f"cp_bytes_paper_{v}_gqa{GQA}"] = L * plan_cp.cp_layer_bytes(v, b, seq, heads, hd, cp, item, kv)
    return ok, figures


def memory_section(comm, grid, cfg, args, cp_peak, one_peak):
    """The meter's peak per rank beside one process's / cp; one layer's saves over s."""
    cp, b = grid.cp, args.batch_size // grid.dp
    peaks = per_rank(comm, cp_peak)
    busiest = max(peaks)
    seq = cfg.block_size
    n_r = max(plan_cp.tokens_of(seq, cp, r, not args.no_load_balance) for r in range(cp))
    whole = cfg.vocab_size * cfg.n_embd * np.dtype(cfg.dtype).itemsize    # wte^T, saved by the head
    say(f"\nactivation memory per rank (the meter's peak over a training step, minidist/context.py)")
    rows = [["one process, whole sequence (blockwise)" if grid.dp == 1 else
             f"one process, its replica's {b} sequences (blockwise)", fmt_bytes(one_peak), ""],
            [f"one process / cp = / {cp}", fmt_bytes(one_peak / cp), ""]]
    want = None
    if grid.tp == 1:
        want = (one_peak - whole) * n_r / seq + whole
        rows.append([f"(one process - V x C) x n_r/s + V x C", fmt_bytes(want),
                     f"n_r = {n_r} of s = {seq} tokens"])
    rows.append(["per rank, measured (busiest)", fmt_bytes(busiest),
                 f"{busiest / (one_peak / cp):.2f} x one process / cp"])
    harness.table(rows, header=["", "bytes", ""])
    if grid.tp == 1:
        say(f"  every activation is per token, and a rank holds n_r tokens; but the head's product\n"
            f"  saves the whole V x C matrix wte^T ({fmt_bytes(whole)}) on every rank")
    else:
        say(f"  tensor parallelism cuts attention and the MLP's inner arrays by tp={grid.tp}, but not the\n"
            f"  residual stream, the layer norms and the embedding (that is sequence parallelism's job)")
    item = np.dtype(cfg.dtype).itemsize
    h, a, d = cfg.n_embd, cfg.n_head, cfg.dropout > 0
    t = grid.tp
    say(f"\none layer's saves per rank by this engine's count (plan.memory.engine_layer_saves; b={b} "
        f"h={h} a={a}" + (f" t={t}" if t > 1 else "") + f",\n{cfg.dtype}{', dropout' if d else ''}): "
        f"the plain attention keeps a*s^2*b probabilities" + (" and a mask" if d else "")
        + ", the blockwise\nkeeps a*s*b log-sum-exps; CP cuts every line by cp")
    rows, figures = [], {}
    for s in (512, 1024, 2048, 4096, 8192):
        plain = sum(n for *_, n in engine_layer_saves(b, s, h, a, t, dropout=d)) * item
        block = sum(n for *_, n in engine_layer_saves(b, s, h, a, t, dropout=d, attention="blockwise")) * item
        with_cp = sum(n for *_, n in engine_layer_saves(b, s // cp, h, a, t, dropout=d,
                                                        attention="blockwise")) * item
        rows.append([s, fmt_bytes(plain), fmt_bytes(block), fmt_bytes(with_cp), f"{plain / with_cp:.0f} x"])
        figures.update({f"layer_bytes_s{s}_plain": plain, f"layer_bytes_s{s}_blockwise": block,
                        f"layer_bytes_s{s}_blockwise_cp{cp}": with_cp})
    harness.table(rows, header=["s", "plain", "blockwise", f"blockwise + cp={cp}", "plain / last"])
    say("  not in the meter: the K, V a rank receives are used within the layer and dropped (the ring\n"
        "  holds two blocks at a time, the all-gather all cp of them, Ulysses its heads' whole sequence)")
    figures.update({"activation_bytes_per_rank_measured": int(busiest),
                    "activation_bytes_per_rank_measured_all": [int(v) for v in peaks],
                    "activation_bytes_one_process_measured": int(one_peak),
                    "activation_bytes_one_process_over_cp": one_peak / cp,
                    "activation_bytes_per_rank_expected": want})
    return figures


def overlap_section(comm, grid, cfg, args, data, rows):
    """The ring's step timed with its messages overlapped and waited for at once."""
    if grid.cp == 1:
        return {}
    times, waits = {}, {}
    models = {o: build_cp(cfg, args, grid, "ring", not args.no_load_balance, overlap=o)
              for o in (True, False)}
    for o in models:
        times[o], waits[o] = [], []
    batches = step_batches(data, args, rows)
    for turn in range(args.timing_reps + 1):          # turn 0 warms up, untimed
        for o, (model, _) in models.items():
            comm.Barrier()
            t0 = time.perf_counter()
            model.reset_counters()
            for x, y, rng in batches:
                _, loss = model(x, y, rng=rng)
                loss.backward()
            zero_grad(model)
            dt = time.perf_counter() - t0
            if turn:
                times[o].append(common.mpi_reduce(comm, dt))
                waits[o].append(common.mpi_reduce(comm, model.exposed_s()))
    t = {o: float(np.median(v)) for o, v in times.items()}
    w = {o: float(np.median(v)) for o, v in waits.items()}
    say(f"\nthe ring's exposed communication: one forward and backward, timed {args.timing_reps} times in turn "
        f"(median,\nslowest rank); wait = time inside MPI waits for the K, V and dK, dV messages")
    harness.table([["overlapped (Isend/Irecv posted before the block's compute)", f"{t[True] * 1e3:.1f}",
                    f"{w[True] * 1e3:.1f}"],
                   ["not overlapped (--no-overlap: each transfer waited for first)", f"{t[False] * 1e3:.1f}",
                    f"{w[False] * 1e3:.1f}"]],
                  header=["ring", "step ms", "wait ms"])
    say(f"  wait with overlap / without: {w[True] / w[False]:.2f}" if w[False] > 0 else "  no wait measured")
    say("  ranks that share cores (more ranks than cores) leave little compute to hide the messages\n"
        "  behind: read the ratio, and run it twice; a GPU with its own copy engines hides more")
    return {"ring_step_s_overlap": t[True], "ring_step_s_no_overlap": t[False],
            "ring_wait_s_overlap": w[True], "ring_wait_s_no_overlap": w[False]}


def idle_barrier(comm):
    """A barrier that sleeps while it waits: MPI's own Barrier spins, and a spinning rank
    would take a core from the rank being timed."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def attention_timing(comm, cfg, args, data, rows):
    """One process, blockwise against plain attention: the forward and backward of the same
    batch, timed in turn on rank 0 alone (the others sleep), and how far their gradients
    are apart (dropout 0: with dropout they draw their masks by different rules)."""
    t, rel = {"plain": 0.0, "blockwise": 0.0}, 0.0
    if comm.Get_rank() == 0:
        plain_cfg = type(cfg)(**{**cfg.__dict__, "attention": "plain"})
        models = {"plain": GPT(plain_cfg, seed=args.seed), "blockwise": GPT(cfg, seed=args.seed)}
        times = {k: [] for k in models}
        batches = step_batches(data, args, rows)
        for turn in range(args.timing_reps + 1):          # turn 0 warms up, untimed
            for k, m in models.items():
                zero_grad(m)
                t0 = time.perf_counter()
                for x, y, rng in batches:
                    _, loss = m(x, y, rng=rng)
                    loss.backward()
                if turn:
                    times[k].append(time.perf_counter() - t0)
        grads = {k: {n: p.grad for n, p in m.named_parameters()} for k, m in models.items()}
        rel = harness.compare(grads["blockwise"], grads["plain"])[0]
        t = {k: float(np.median(v)) for k, v in times.items()}
    idle_barrier(comm)
    t = dict(zip(t, common.mpi_reduce(comm, list(t.values()))))
    rel = float(common.mpi_reduce(comm, rel)) if cfg.dropout == 0 else None
    b = rows.stop - rows.start
    say(f"\nblockwise against plain attention, one process (rank 0 alone, the others asleep): forward\n"
        f"and backward of b={b} s={cfg.block_size}, median of {args.timing_reps} turns")
    harness.table([["plain (keeps the probabilities)", f"{t['plain'] * 1e3:.1f}", "1.00"],
                   [f"blockwise (tiles of {cfg.attn_block})", f"{t['blockwise'] * 1e3:.1f}",
                    f"{t['blockwise'] / t['plain']:.2f}"]], header=["attention", "ms", "/ plain"])
    say("  the blockwise loop walks tiles in Python and recomputes the scores in backward; it saves\n"
        "  the s x s arrays' memory and their trips through it"
        + (f"\n  their gradients differ by max_rel_diff {rel:.1e} (the same sums, in another order)"
           if rel is not None else "\n  (with dropout the two draw their masks by different rules: not compared)"))
    return {"step_time_s_plain": t["plain"], "step_time_s_blockwise": t["blockwise"],
            "blockwise_over_plain_time": t["blockwise"] / t["plain"],
            "blockwise_vs_plain_max_rel_diff": rel}


# ----------------------------------------------------------------------------- the lesson

def main(args):
    comm = harness.comm_world()
    world = comm.Get_size()
    cfg = config(args, world)
    tp, cp, dp, per_dp = check_input(args, cfg, world)
    data = common.load_dataset(args, comm)
    grid = ProcessGrid(tp=tp, cp=cp, comm=comm)
    variant, lb = args.variant, not args.no_load_balance
    overlap = not args.no_overlap
    say(f"Lesson 13: context parallelism, {NAMES[variant]}, cp={cp}" + (f" x tp={tp}" if tp > 1 else "")
        + (f" x dp={dp}" if dp > 1 else "") + f" on {harness.ranks(world)},\n"
        + ("load-balanced (zigzag) chunks" if lb else "naive (contiguous) chunks")
        + ("" if overlap or variant != "ring" else ", messages not overlapped") + "\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} seq={cfg.block_size} "
        f"vocab={cfg.vocab_size} dropout={cfg.dropout} {cfg.dtype};\n        blockwise attention in tiles of "
        f"{cfg.attn_block} positions")
    say(f"batch   global {args.batch_size} sequences" + (f" = {dp} replicas x {per_dp}" if dp > 1 else "")
        + f";\n        each of the cp={cp} ranks of a replica holds its chunks of all {per_dp}")
    say(f"steps   {args.steps} AdamW steps, " + (f"clipping at global norm {args.grad_clip}" if args.grad_clip
                                                  else "no clipping") + "\n")
    layout_picture(cfg.block_size, cp, lb)
    if cp == 1:
        say("  cp=1: one rank holds the whole sequence and sends nothing; run with more ranks than --tp")

    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    rows = shard_slice(args.batch_size, grid.dp_rank, dp)

    # --- the context-parallel run: every rank builds the whole GPT, keeps its chunks' tokens
    model, sync = build_cp(cfg, args, grid, variant, lb, overlap)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    STATS.reset()
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    model.reset_counters()
    losses, state, times = common.train_and_collect(model, opt, data, args, tc, rows, 1, sync)
    cp_peak = MEMORY.peak_bytes - base
    work = (STATS.tiles_forward, STATS.tiles_backward, STATS.scores_forward, STATS.scores_backward)
    sent = sum(model.cp_bytes().values()) // args.steps
    losses = list(common.mpi_reduce(grid.dp_comm, losses, "sum") / dp)
    state = gather_all(model, state, grid)

    # --- the reference: one process, the whole sequence, this replica's rows (blockwise too)
    ref = GPT(cfg, seed=args.seed)
    ref_opt = ref.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    ref_losses, ref_state, ref_times = common.train_and_collect(ref, ref_opt, data, args, tc)
    one_peak = MEMORY.peak_bytes - base
    if dp > 1:                          # one process on this replica's rows: the peak to cut by cp
        MEMORY.reset_peak()
        base = MEMORY.live_bytes
        one_step_work(GPT(cfg, seed=args.seed), data, args, rows)
        one_peak = MEMORY.peak_bytes - base
    state["loss"], ref_state["loss"] = np.array(losses), np.array(ref_losses)
    rel, abs_diff, _ = harness.compare(state, ref_state)
    rel, abs_diff = common.mpi_reduce(comm, [rel, abs_diff])
    tol = harness.TOLERANCE[cfg.dtype]
    match = bool(rel <= tol)
    against = f"cp={cp}" + (f" x tp={tp}" if tp > 1 else "") + (f" x dp={dp}" if dp > 1 else "")
    common.report_comparison(comm, against, ref_losses, losses, state, ref_state, tol, show_where="",
                             notes=["the reference: one process, the whole sequence, the same blockwise "
                                    "attention\n    (tiles of the same size), the same dropout masks"]
                             + (["tensor-parallel shards gathered back to whole tensors"] if tp > 1 else []))

    # --- work, bytes, memory, overlap, one process's attention
    other_model, _ = build_cp(cfg, args, grid, variant, not lb, overlap)
    other = one_step_work(other_model, data, args, rows)
    del other_model
    work_ok, figures = work_section(comm, grid, cfg, args, variant, lb, work, other, args.steps)
    bytes_ok, f_bytes = bytes_section(comm, grid, cfg, args, variant, lb, sent)
    figures.update(f_bytes)
    figures.update(memory_section(comm, grid, cfg, args, cp_peak, one_peak))
    if variant == "ring":
        figures.update(overlap_section(comm, grid, cfg, args, data, rows))
    else:
        say("\nthe ring's overlap of messages and compute: run --variant ring (Ulysses' all-to-alls and\n"
            "the all-gather wait on the critical path)")
    figures.update(attention_timing(comm, cfg, args, data, rows))

    step_time = common.mpi_reduce(comm, float(np.median(times)))
    mem = {"params": int(common.mpi_reduce(comm, sum(p.data.nbytes for p in model.parameters()))),
           "grads": int(common.mpi_reduce(comm, sum(p.grad.nbytes for p in model.parameters()
                                                    if p.grad is not None))),
           "optimizer": int(common.mpi_reduce(comm, opt.state_bytes())),
           "activations_peak": int(figures["activation_bytes_per_rank_measured"])}
    report = harness.new_report(
        "13_context_parallel", args,
        parallel={"cp": cp, "tp": tp, "dp": dp, "pp": 1, "variant": variant, "load_balance": lb,
                  "overlap": overlap, "attn_block": cfg.attn_block},
        match=bool(match and work_ok and bytes_ok), max_rel_diff=rel, max_abs_diff=abs_diff, tolerance=tol,
        losses={"reference": ref_losses, "parallel": losses},
        comm={"bytes_sent": {"cp_attention": figures["cp_bytes_measured"]},
              "expected_bytes": {"cp_attention": figures["cp_bytes_formula"]}},
        memory=mem, step_time_s=step_time, figures=figures)
    say("\nthe verdict needs: losses, raw gradients and weights within the tolerance; every rank's tiles,\n"
        "score elements and attention bytes equal to plan/context.py's counts")
    if not work_ok:
        say("\nthe tiles or score elements measured differ from plan/context.py's count")
    if not bytes_ok:
        say("\nthe attention bytes measured differ from cp_sent: a message too many, or of the wrong size")
    return harness.finish(report, args)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    g = p.add_argument_group("model and data")
    g.add_argument("--n-layer", type=harness.positive_int, default=2)
    g.add_argument("--n-head", type=harness.positive_int, default=4)
    g.add_argument("--n-embd", type=harness.positive_int, default=64)
    g.add_argument("--seq", "--block-size", dest="block_size", metavar="S", type=harness.positive_int, default=256,
                   help="sequence length s (default %(default)s)")
    g.add_argument("--batch-size", type=harness.positive_int, default=4,
                   help="the global batch in sequences (default %(default)s)")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability in [0, 1), attention's too")
    g.add_argument("--data", metavar="PATH", help="a UTF-8 text file (default: Python stdlib source)")
    p.add_argument("--cp", type=harness.positive_int, help="context-parallel size (default: the world / --tp)")
    p.add_argument("--tp", type=harness.positive_int, help="tensor-parallel size (default 1)")
    p.add_argument("--variant", default="ring", metavar="|".join(VARIANTS),
                   help="how attention gets the other ranks' keys and values (default %(default)s)")
    p.add_argument("--no-load-balance", action="store_true",
                   help="contiguous chunks 2r, 2r+1 instead of the zigzag r, 2cp-1-r")
    p.add_argument("--no-overlap", action="store_true",
                   help="ring: wait for each K, V transfer before computing (default: overlapped)")
    p.add_argument("--attn-block", type=harness.positive_int, default=64,
                   help="tile of the blockwise attention, in positions (default %(default)s)")
    p.add_argument("--timing-reps", type=harness.positive_int, default=3,
                   help="turns of the interleaved timings (default %(default)s)")
    common.add_step_flags(p)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
