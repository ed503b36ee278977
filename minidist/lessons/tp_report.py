"""Lesson 03's two longer reports, kept out of the lesson's story: activation memory of one
layer measured beside its formulas, and generation with the sharded model beside one
process.

    mpirun -n 8 python -m minidist.lessons.03_tensor_parallel --generate 32

Both measure first and put the formula beside the measurement, never in its place:
activation bytes come from the engine's meter (minidist/context.py's MEMORY), bytes sent
from minidist.comm.stats, tokens from two real generations.
"""
import time

import numpy as np
from mpi4py import MPI

from minidist.comm import chunk_bounds, stats
from minidist.backend import to_device, to_numpy, xp
from minidist.data import decode
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT, generate_greedy
from minidist.parallel.sequence_parallel import sequence_bounds
from minidist.parallel.tp_formulas import generation_bytes, generation_feeds, measured_saved_bytes
from minidist.parallel.tp_model import TensorParallelGPT
from minidist.plan.memory import engine_layer_elements, kv_cache_bytes, korthikanti_layer_bytes
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor

# ----------------------------------------------------------------------------- activations


def activation_table(cfg, b, tp_comm, seed):
    """One transformer layer's saved bytes per rank, four ways: one process, tensor
    parallel, tensor + sequence parallel (Megatron's: the column layers keep their slice
    and gather it again in backward) and SP keeping the gathered inputs; each measured,
    beside this engine's count and Korthikanti et al.'s formula. Then the paper's identity:
    TP + SP per rank times t against one process. Returns (every measurement equals the
    count and the identity holds, figures)."""
    s, h, a, t, item = cfg.block_size, cfg.n_embd, cfg.n_head, tp_comm.Get_size(), np.dtype(cfg.dtype).itemsize
    x = to_device(np.random.default_rng(seed).standard_normal((b, s, h)).astype(cfg.dtype))  # the layer's input
    lo, hi = sequence_bounds(s, tp_comm)

    def rng():
        return DropoutRNG(seed, 0, range(b)) if cfg.dropout > 0 else None

    def layer(**kw):
        return TensorParallelGPT(GPT(cfg, seed=seed), tp_comm, **kw).transformer.h[0]

    one, tp = GPT(cfg, seed=seed).transformer.h[0], layer()
    sp, kept = layer(sequence_parallel=True), layer(sequence_parallel=True, sp_keep_gathered=True)
    mine_sp, paper_sp = dict(t=t, s_r=hi - lo), dict(t=t, sequence_parallel=True)
    rows = [("1 process", "1_process", lambda: one(Tensor(x), rng()), dict(t=1), dict(t=1)),
            (f"tp={t}", f"tp{t}", lambda: tp(Tensor(x), rng(), None), dict(t=t), dict(t=t)),
            (f"tp={t} + SP", f"tp{t}_SP", lambda: sp(Tensor(x[:, lo:hi]), rng(), (s, lo, hi)),
             mine_sp, paper_sp),
            ("  kept gathered", f"tp{t}_SP_keep_gathered", lambda: kept(Tensor(x[:, lo:hi]), rng(), (s, lo, hi)),
             dict(mine_sp, regather=False), paper_sp)]
    say(f"\nactivation memory of one transformer layer, per rank (s={s} b={b} h={h} a={a} t={t}; "
        f"{cfg.dtype}, dropout {cfg.dropout})")
    table, figures, ok, largest, total = [], {}, True, {}, {}
    for name, key, forward, mine, paper in rows:
        measured = measured_saved_bytes(forward)
        count = sum(engine_layer_elements(b, s, h, a, dropout=cfg.dropout > 0, **mine).values()) * item
        same = bool(common.mpi_reduce(tp_comm, float(measured != count)) == 0)
        total[key] = common.mpi_reduce(tp_comm, float(measured), "sum")
        measured, count = common.mpi_reduce(tp_comm, [measured, count])     # the largest rank's
        largest[key] = measured
        ok &= same
        k = korthikanti_layer_bytes(s, b, h, a, **paper)
        table.append([name, fmt_bytes(measured), fmt_bytes(count), "equal" if same else "DIFFERENT", fmt_bytes(k),
                      f"{measured / k:.1f}x"])
        figures.update({f"activation_bytes_layer_{key}_measured": measured,
                        f"activation_bytes_layer_{key}_engine_count": count,
                        f"activation_bytes_layer_{key}_korthikanti": k})
    harness.table(table, header=["", "measured", "this engine's count", "", "Korthikanti (16-bit)", "measured / paper"])
    say("  (per rank: the largest rank's; \"kept gathered\": TP + SP with --sp-keep-gathered)")
    ok &= identity(largest, total, t, s, figures)
    say("  Korthikanti et al. 2022 per layer: 34sbh + 5as^2b (one process), 10sbh + 24sbh/t + 5as^2b/t (TP),\n"
        "  34sbh/t + 5as^2b/t (TP + SP), in bytes of 16-bit activations and 1-byte dropout masks. Here:")
    say(f"  - every saved array is {cfg.dtype} ({item} B an element), dropout masks too (the paper: 2 B, masks 1 B);")
    say("  - attention saves its probabilities and the mask (2 as^2b elements), not also the dropped\n"
        "    probabilities (the paper's 5as^2b bytes = 2 + 1 + 2); a layer norm saves its normalised input\n"
        "    and 1/std per token (2 b*s), not its input;")
    say("  - without dropout no masks are saved (the paper always counts them);")
    say("  - TP + SP: c_attn and c_fc keep only their rank's slice and gather it again in backward\n"
        "    (Megatron's way): every array of the layer is cut by t, so the measured / paper column\n"
        "    is the one-process row's, the dtype and mask-size factor alone;")
    say("  - kept gathered: c_attn and c_fc keep the all-gathered input whole (2 b*s*h per rank),\n"
        "    and the backward needs no re-gather: 2 all-gathers fewer per layer (the bytes above).")
    return ok, figures


def identity(largest, total, t, s, figures):
    """Korthikanti et al.'s identity, measured: TP + SP per rank times t is one process's
    layer. Prints the ratio and its verdict for both SP variants; True when Megatron's holds
    within 3% (the largest rank's slice where t divides s, the sum over ranks where not)."""
    one = largest["1_process"]
    sizes = np.diff(chunk_bounds(s, t))                       # the tokens of each rank (sequence_bounds)
    even = len(set(sizes.tolist())) == 1
    say(f"  TP + SP x t against one process (s={s} tokens over t={t}: "
        + (f"{sizes[0]} per rank)" if even else f"uneven slices of {min(sizes)} to {max(sizes)} tokens)"))
    key, kept_key = f"tp{t}_SP", f"tp{t}_SP_keep_gathered"
    ratio, summed = t * largest[key] / one, total[key] / one
    kept = t * largest[kept_key] / one
    ok = abs(ratio - 1) <= 0.03 if even else abs(summed - 1) <= 0.03
    say(f"    TP + SP        {t} x {fmt_bytes(largest[key])} = {ratio:.3f} x one process; "
        f"summed over the ranks {summed:.3f} x")
    say(f"    kept gathered  {t} x {fmt_bytes(largest[kept_key])} = {kept:.3f} x one process (the gathered inputs)")
    read = "TP + SP x t" if even else "TP + SP summed over the ranks"
    say(f"    verdict: {read} within 3% of one process: "
        + ("yes, the paper's identity holds" if ok else "NO, the identity does not hold"))
    figures.update({"activation_layer_tp_sp_times_t_over_one_process": ratio,
                    "activation_layer_tp_sp_summed_over_one_process": summed,
                    "activation_layer_tp_sp_keep_gathered_times_t_over_one_process": kept})
    if not even:
        say("    (uneven slices: the largest rank holds more than 1/t of the tokens, so t x the largest\n"
            "    exceeds one process; the verdict reads the sum over the ranks instead)")
    return ok


# ----------------------------------------------------------------------------- generation


def _idle_barrier(comm):
    """A barrier that sleeps instead of spinning: MPI's own busy-polls the cores it waits
    on, and rank 0 is timing one process on those cores."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _cores():
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def shown(label, text, width=100, run=12):
    """'  label       'text'' in lines of at most `width`: a run of more than `run` equal
    characters (greedy decoding of a briefly trained model repeats one byte) is written once
    with its count, and what is left is cut into pieces that continue under the first."""
    import re
    parts = []
    for m in re.finditer(r"(.)\1{%d,}|(?:(.)(?!\2{%d}))+" % (run, run), text, re.S):
        piece = m.group(0)
        parts.append(f"{piece[0]!r} x {len(piece)}" if len(piece) > run and len(set(piece)) == 1 else repr(piece))
    body = " + ".join(parts) if len(parts) != 1 else parts[0]
    head, lines = f"  {label:<11} ", []
    room = width - len(head)
    while len(body) > room:
        cut = body.rfind(" ", 0, room) + 1           # after a space (kept, at the line's end), else anywhere
        cut = cut if cut > room // 2 else room
        lines.append(body[:cut])
        body = body[cut:]
    lines.append(body)
    return "\n".join((head if i == 0 else " " * len(head)) + line for i, line in enumerate(lines))


def generation_report(model, ref, data, n, grid):
    """Greedy decoding of n tokens with the sharded model and with one process; returns
    (same tokens, figures). The prompt is the start of a validation sequence, short
    enough that the whole generation fits in block_size positions when n allows."""
    comm, cfg = harness.comm_world(), model.config
    p = max(1, min(8, cfg.block_size - n + 1))
    prompt = np.ascontiguousarray(data.get_batch("val", 1, 0)[0][:, :p])
    V = cfg.vocab_size

    # one process, on rank 0 alone
    ref_tokens = np.zeros((1, p + n), np.int64)
    ref_logits = np.zeros((n, 1, V), np.float64)
    t_one = np.zeros(1)
    if comm.Get_rank() == 0:
        t0 = time.perf_counter()
        toks, logits = generate_greedy(ref, prompt, n)
        t_one[0] = time.perf_counter() - t0
        ref_tokens[...], ref_logits[...] = toks, to_numpy(xp.stack(logits))   # home in one copy
    _idle_barrier(comm)
    for buf in (ref_tokens, ref_logits, t_one):
        comm.Bcast(buf, root=0)

    # the tensor-parallel group (each data-parallel replica generates the same tokens)
    comm.Barrier()
    with stats.measure() as m:
        t0 = time.perf_counter()
        tokens, logits = generate_greedy(model, prompt, n)
        t_tp = common.mpi_reduce(comm, time.perf_counter() - t0)
    logits = to_numpy(xp.stack(logits))                 # every step's logits home in one copy
    same = bool(common.mpi_reduce(comm, float(not np.array_equal(tokens, ref_tokens))) == 0)

    # logits of every step: my vocabulary columns against the same columns of one process
    lo, cols = model.lo, min(model.lo + logits[0].shape[-1], V) - model.lo
    rel = 0.0
    for mine, want in zip(logits, ref_logits):
        mine, want = mine.astype(np.float64)[:, :max(cols, 0)], want[:, lo:lo + max(cols, 0)]
        d = float(np.abs(mine - want).max(initial=0.0))
        d, scale = common.mpi_reduce(grid.tp_comm, [d, float(np.abs(want).max(initial=0.0))])
        rel = max(rel, d / scale)
    rel = common.mpi_reduce(comm, rel)

    want_bytes = sum(generation_bytes(model, 1, f)["all_reduce"][1] for f in generation_feeds(p, n, cfg.block_size))
    got_bytes = int(common.mpi_reduce(comm, m.bytes_sent("all_reduce")))
    want_bytes = int(common.mpi_reduce(comm, want_bytes))
    one_rate, tp_rate = n / t_one[0], n / t_tp
    cache = model.new_cache()
    shape = (1, cfg.block_size, cfg.n_layer, cfg.n_embd, np.dtype(cfg.dtype).itemsize)   # b s L h item
    cache_bytes, cache_rank = kv_cache_bytes(*shape), kv_cache_bytes(*shape, model.tp)

    say(f"\ngeneration: greedy, {n} tokens after a prompt of {p}, batch 1, with a KV cache")
    for label, ids in (("prompt", prompt[0]), ("1 process", ref_tokens[0, p:]), (f"tp={model.tp}", tokens[0, p:])):
        say(shown(label, decode(ids)))
    say(f"  same tokens: {'yes' if same else 'NO'}; logits of every step: max_rel_diff {rel:.1e}\n"
        "  (each rank's vocabulary columns, padding left out)")
    if len(set(ref_tokens[0, p:].tolist())) <= 3:
        say("  (a model trained for a few steps has mostly learned which bytes are common, so greedy\n"
            "  decoding repeats them; the logits of every step, compared above, are the stronger check)")
    if p + n - 1 > cfg.block_size:
        say(f"  past block_size {cfg.block_size}, positions shift: those steps run the cropped window whole")
    harness.table([["1 process (rank 0 alone)", f"{one_rate:,.0f}", fmt_bytes(cache_bytes), "-", "-"],
                   [f"tp={model.tp} group", f"{tp_rate:,.0f}", fmt_bytes(cache_rank),
                    f"{got_bytes:,}", f"{want_bytes:,}" + (" (equal)" if got_bytes == want_bytes else " (DIFFERENT)")]],
                  header=["", "tokens/s", "KV cache per rank", "bytes sent per rank", "by formula"])
    say(f"  per token: {2 * cfg.n_layer + 1} all-reduces of b*h (embedding, attention and MLP of each layer)\n"
        f"  and 2 of b (the greedy token); each is a wait for every rank of the group. Here {comm.Get_size()} "
        f"processes\n  share {_cores()} cores and the model is tiny: those waits cost far more than the 1/t of the "
        "matmuls saves.\n  On GPUs of one node, TP cuts the latency of a token of a model too big for one GPU\n"
        "  (DeepSpeed-Inference).")
    del cache
    figures = {"generate_tokens": n, "generate_same_tokens": float(same), "generate_logits_max_rel_diff": rel,
               "generate_tokens_per_s_1_process": one_rate, "generate_tokens_per_s_tp": tp_rate,
               "generate_bytes_sent": got_bytes, "generate_bytes_formula": want_bytes}
    return same and got_bytes == want_bytes, figures
