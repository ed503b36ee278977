"""Lesson 12: planning a real run. One cost model (minidist/plan/) carries the formulas of
lessons 00-11 from this machine's ranks to a thousand GPUs, and is checked against
published runs.

Over 400 lines but one story: plan_story walks named sections (a model's states, the best
layouts, why TP stays in a node, costs, the choice, published runs, the measurement), each a
function; the arithmetic lives in minidist/plan/.

    python -m minidist.lessons.12_plan
    python -m minidist.lessons.12_plan --gpus 2048 --gpu a100-80gb --json out.json
    python -m minidist.lessons.12_plan --params 175e9 --cap-gb 60
    mpirun -n 8 python -m minidist.lessons.12_plan --measure     # + the time-scaled cluster,
                                                  # about 5 minutes on a two-core laptop

Walked through, every figure computed by minidist.plan from the inputs (a parameter count
or a shape, a GPU's name, a GPU count): a 70B model's states (as planning guides quote
them, corrected) and why one H200 cannot hold them; the best layouts for --gpus GPUs
(plan.search); why tensor parallelism stays inside a node; what the bubble, the first
stage's activations and the data-parallel reduction cost in a planning guide's layout
(TP 8, PP 8, DP 16 at 1024 GPUs); the fastest layout under a memory cap (plan.choose); the
planner against published runs (plan.published), Llama 3's 128K stage with context
parallelism among them.

Checked, each a verdict: the ZeRO paper's 7.5B-on-64 figures reproduced; the bubble and
the first stage's micro-batches in flight equal to the schedule simulated in logical time
(parallel/schedules.py); each chosen layout fits and nothing that fits is faster; with
--measure, the planner's ranking of lesson 07's layouts on a time-scaled cluster agreeing
with the measured one (Spearman's rho at least 0.8, the measured best among the predicted
best two). The published rows are printed against the course's goals (held out by source:
mean error at most 10%, worst at most 20%; in sample: 5% and 10%), met or not met: the
cost model's accuracy, not the lesson's arithmetic, so a goal not met does not fail the run.
"""
import textwrap
from fractions import Fraction

from minidist.lessons import harness
from minidist.lessons.harness import say
from minidist.parallel import schedules
from minidist.plan import choose as choosing
from minidist.plan import cluster as clusters
from minidist.plan.cluster import ranks_per_node
from minidist.plan import collectives, cost, layout, memory, pipeline, published, search, traffic

GB = 1e9                          # the papers' GB
SEED_PSI = 70e9                   # planning guides' "70B-parameter model"
SEED_ROUGH = 560e9                # their "~560 GB" (quoted to be corrected: lessons/12_plan.md)
ZERO_PAPER = (7.5e9, 64, ("120", "31.4", "16.6", "1.9"))   # Rajbhandari et al. 2020, Figure 1 (GB)
# Llama 2 70B's shape (Touvron et al. 2023, arXiv 2307.09288, Table 1 and the released config):
# a real 70B model, counted parameter by parameter
LLAMA2_70B = dict(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, global_batch=1024,
                  ffn_hidden=28672, kv_heads=8, swiglu=True)
GOAL_MEAN, GOAL_WORST = 0.05, 0.10    # the course's goals for the published rows, in sample
GOAL_HELD_MEAN, GOAL_HELD_WORST = 0.10, 0.20   # and leave-one-source-out
GOAL_RHO = 0.8                        # and for the time-scaled cluster


def gb(x):
    return f"{x / GB:,.1f} GB"


def build_parser():
    # no --steps (nothing trains) and no --dtype (the planner computes in Python numbers)
    p = harness.parser(__doc__.split("\n\n")[0], steps=None, dtype=None)
    p.add_argument("--params", type=harness.positive_float, default=SEED_PSI,
                   help="the model to plan, in parameters (GPT shape family; default 70e9, a guide's example)")
    p.add_argument("--gpus", type=harness.positive_int, default=1024, help="GPUs to plan for (default 1024)")
    p.add_argument("--gpu", choices=sorted(clusters.GPUS), default="h100-sxm", help="GPU type (default h100-sxm)")
    p.add_argument("--cap-gb", type=harness.positive_float, default=40.0,
                   help="a tighter memory budget per GPU for the choice (GB; default 40)")
    p.add_argument("--no-published", dest="published", action="store_false",
                   help="skip the published-run table (a second or so)")
    p.add_argument("--measure", action="store_true",
                   help="run lesson 07's layouts on a time-scaled cluster (mpirun -n 8) beside the "
                        "predictions (about 5 minutes on two cores)")
    return p


# ----------------------------------------------------------------------------- 1. a 70B model

def model_states():
    """A 70B model: its states by the ZeRO paper's count, why one H200 cannot hold them."""
    say("1. Model states of a 70B model (plan.memory.model_state_bytes; Rajbhandari et al. 2020)")
    zero = memory.model_state_bytes(SEED_PSI, 1, 0, "zero")
    mega = memory.model_state_bytes(SEED_PSI, 1, 0, "megatron")
    total, total_m = sum(zero.values()), sum(mega.values())
    rows = [[cat, f"{w} B", gb(zero[cat]), f"{mw} B", gb(mega[cat])]
            for cat, w, mw in zip(("weights", "grads", "optimizer"), memory.ACCOUNTING["zero"],
                                  memory.ACCOUNTING["megatron"])]
    rows.append(["total", f"{sum(memory.ACCOUNTING['zero'])} B", gb(total),
                 f"{sum(memory.ACCOUNTING['megatron'])} B", gb(total_m)])
    harness.table(rows, ["70e9 parameters", "ZeRO paper", "(fp16)", "Megatron-LM", "(bf16)"])
    w32, per32 = memory.ACCOUNTING["fp32"][0], sum(memory.ACCOUNTING["fp32"])
    say(f"  A planning guide's ~{gb(SEED_ROUGH)} is {SEED_ROUGH / zero['weights']:g} x the {gb(zero['weights'])} of "
        f"16-bit weights\n  (its \"4x the model size\"). 16 B per parameter are {per32 / w32:g} x the weights "
        f"only when they are {w32}-byte\n  fp32 ones; over 2-byte weights they are "
        f"{total / zero['weights']:g} x: {total / SEED_ROUGH:g} x the guide's figure.")
    real, k = layout.Model(**LLAMA2_70B), LLAMA2_70B
    say(f"  A real 70B shape, Llama 2 70B (L {k['layers']}, h {k['hidden']}, {k['kv_heads']} KV heads, SwiGLU "
        f"{k['ffn_hidden']}, V {k['vocab']}), counted\n  from its shape: {real.params():,} parameters, "
        f"{gb(sum(memory.model_state_bytes(real.params(), 1, 0, 'zero').values()))} of states.")
    h200 = clusters.GPUS["h200"]
    usable = cost.USABLE_MEMORY * h200.memory_bytes
    need = next((n for n in range(1, 1 << 14) if sum(memory.model_state_bytes(SEED_PSI, n, 3).values()) <= usable),
                None)
    say(f"  One H200 holds {gb(h200.memory_bytes)} (nvidia-smi's {h200.memory_bytes / 2 ** 20:,.0f} MiB; "
        f"the datasheet's \"141 GB\" is a round\n  name): the states are {total / h200.memory_bytes:.1f}x "
        f"that; the 16-bit weights alone ({gb(zero['weights'])}) leave {gb(h200.memory_bytes - zero['weights'])}."
        f"\n  Cut by ZeRO-3 over n GPUs (16 x 70e9 / n), they fit in {cost.USABLE_MEMORY:.0%} of an H200 "
        f"({gb(usable)}) "
        + (f"from n = {need},\n  before a single activation.\n" if need else "for NO n up to 16,384.\n"))
    return {"psi": SEED_PSI, "zero": zero, "megatron": mega, "llama2_70b_params": real.params(),
            "h200_bytes": h200.memory_bytes, "zero3_h200s_needed": need}


def zero_paper():
    """The paper's own example beside the formula: Psi = 7.5e9 on N_d = 64, Figure 1."""
    psi, n_d, published_gb = ZERO_PAPER
    got = [sum(memory.model_state_bytes(psi, n_d, stage).values()) for stage in range(4)]
    ours = [f"{x / GB:.4g}" for x in got]
    decimals = [len(p.partition(".")[2]) for p in published_gb]     # the paper's own digits
    ok = [f"{x / GB:.{k}f}" for x, k in zip(got, decimals)] == list(published_gb)
    say(f"  The paper's own example, 7.5B on 64 devices, stages 0-3: {', '.join(ours)} GB;\n"
        f"  its Figure 1: {', '.join(published_gb)} GB: {'the same' if ok else 'DIFFERENT'} to the "
        "paper's digits.\n")
    return ok, {"computed_bytes": got, "published_gb": list(published_gb)}


# ----------------------------------------------------------------------------- 2. layouts

def layout_text(lay):
    extra = [f"v{lay.chunks}" if lay.chunks > 1 else "", "SP" if lay.sequence_parallel else "",
             {"none": "", "selective": "sel", "full": "full"}[lay.recompute]]
    return (f"{lay.tp}x{lay.pp}x{lay.dp} mb{lay.micro_batch} z{lay.zero} "
            + " ".join(e for e in extra if e)).strip()


def layout_rows(ests):
    return [[layout_text(e.layout), gb(e.memory_bytes_per_gpu), "yes" if e.fits else "NO",
             f"{e.step_time_s:.2f}", f"{e.compute_s:.2f}", f"{e.tp_s:.2f}", f"{e.bubble_s:.2f}",
             f"{e.pp_s:.2f}", f"{e.dp_s:.2f}", f"{e.optimizer_s:.2f}", f"{e.mfu:.1%}"] for e in ests]


HEADER = ["tp x pp x dp", "memory", "fits", "step s", "comp", "TP", "bubble", "PP", "DP", "opt", "MFU"]


def best_layouts(model, cluster, ests):
    g = cluster.gpu
    say(f"2. The best layouts for {cluster.gpus} {g.name}: {g.peak_flops / 1e12:.0f} TFLOP/s dense "
        f"16-bit, {gb(g.memory_bytes)}, matrix\n   products at {g.matmul_efficiency:.0%} of the peak "
        "(one constant per GPU type, fitted to that type's published\n   rows in section 6, "
        "plan.cluster: a whole step's matrix products, not a GEMM benchmark)"
        + (";\n   H100's to Llama 3's and MosaicML's rows, among them Llama 3's 128K, whose DP 8 is\n"
           "   inferred (Table 4 prints DP 4, which fits neither its GPUs nor its tokens)"
           if g.matmul_efficiency == clusters.H100_EFFICIENCY else ""))
    say(f"   model (plan.layout.model_from_params): L {model.layers}, h {model.hidden}, {model.heads} heads, "
        f"V {model.vocab}, s {model.seq},\n   {model.params():,} parameters; global batch "
        f"{model.global_batch} sequences ({model.global_batch * model.seq:,} tokens)")
    say(f"   {len(ests):,} legal layouts estimated (plan.search); fits: at most {cost.USABLE_MEMORY:.0%} "
        "of the memory. Seconds per step:")
    harness.table(layout_rows(ests[:5]), HEADER, indent="   ")
    say("   (tp x pp x dp, micro-batch, ZeRO stage, v chunks, SP = sequence parallel, recompute sel/full)")
    if g.name == "h100-sxm":
        say("   MFU beside what H100 runs publish (model FLOPs over the dense BF16 peak): Llama 3 405B\n"
            "   38-43% (Grattafiori et al. 2024, Table 4), Megatron-LM 41-48% (its README, weak scaling).\n"
            "   The often-quoted \"40-60% MFU on H100\": its lower half is what they reach, its upper\n"
            "   half none of them (lessons/12_plan.md, What MFU to expect on H100s)")
    say("")


def why_tp_8(model, cluster):
    """The best layout with TP inside a node (8) beside the best with TP across two (16)."""
    if model.heads % 16 or cluster.gpus % 16 or cluster.gpus_per_node != 8:
        return None
    in_node = search.search(model, cluster, top=1, tp=8)
    across = search.search(model, cluster, top=1, tp=16)
    if not in_node or not across:
        return None
    gpn = cluster.gpus_per_node
    a_in, bw_in = cluster.link(8, ranks_per_node(1, 8, gpn))
    a_x, bw_x = cluster.link(16, ranks_per_node(1, 16, gpn))
    say(f"3. Why TP stays at 8: its all-reduces of b s h, 4 per layer and micro-batch, run on the link "
        f"the\n   group spans: NVLink, {bw_in / GB:.0f} GB/s per GPU inside a node; across two nodes "
        f"(TP 16) the node's {gpn}\n   NICs together, {bw_x / GB:.0f} GB/s a GPU (one ring per NIC, "
        f"as NCCL lays them), and each message step\n   pays the network's latency, "
        f"{a_x * 1e6:.0f} us against NVLink's {a_in * 1e6:.0f} us")
    harness.table(layout_rows(in_node + across), HEADER, indent="   ")
    e8, e16 = in_node[0], across[0]
    say(f"   On the same GPUs, TP 16 leaves each GPU the same FLOPs (dp halves), but its collectives "
        f"cross\n   the network: TP {e16.tp_s:.2f} s beside {e8.tp_s:.2f} s, a step "
        f"{e16.step_time_s / e8.step_time_s:.2f}x as long. Hence Narayanan et al. 2021's\n"
        "   takeaway #1 (section 3): tensor parallelism up to the GPUs of a node, pipelines across nodes.\n")
    return {"tp8": e8.as_dict(), "tp16": e16.as_dict()}


# ----------------------------------------------------------------------------- 4. one layout's costs

def costs(model, cluster, est, seed):
    """The bubble, the first stage's activations and the DP reduction of one layout, each
    from its formula; the bubble and the micro-batches in flight beside the simulation."""
    lay = est.layout
    t, p, d, b, v = lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.chunks
    m = model.global_batch // (d * b)
    name = "interleaved" if v > 1 else "1f1b"
    say(f"4. What a pipeline costs: {layout_text(lay)}, m = {m} micro-batches per step\n   ("
        + ("the best with tp 8 and pp 8: a planning guide's TP 8, PP 8, DP 16 at 1024 GPUs)" if seed else
           "the best layout with a pipeline)" if p > 1 else "no layout with a pipeline fits: p = 1, no bubble)"))
    frac = pipeline.bubble_fraction(name, p, m, v)
    flight = pipeline.in_flight(p, m, v)
    sim = schedules.simulate(schedules.build(name, p, m, v), p, m, v)
    sim_flight = Fraction(sim.peak[0], v)
    ok_bubble, ok_flight = sim.bubble == frac, flight == sim_flight
    say(f"   bubble ({name}, plan.pipeline.bubble_fraction): (p-1)/(v m + p-1) = {frac} of compute\n"
        f"   + bubble, {est.bubble_s:.2f} s ({est.bubble_s / est.step_time_s:.1%} of the whole step); "
        f"the schedule simulated in\n   logical time idles {sim.bubble}: {'the same' if ok_bubble else 'DIFFERENT'}")
    layers = layout.stage_layers(model.layers, p)[0]
    per_layer = memory.activation_layer_bytes(model.seq, b, model.hidden, model.heads, t, lay.sequence_parallel,
                                              lay.recompute)
    say(f"   first stage: {flight} micro-batches in flight (plan.pipeline.in_flight; the simulation's "
        f"peak: {sim_flight},\n   {'the same' if ok_flight else 'DIFFERENT'}) x {layers} layers x "
        f"{per_layer / 1e6:,.0f} MB per layer ({lay.recompute} recompute, Korthikanti et al.) =\n   "
        f"{gb(float(flight) * layers * per_layer)} of activations, beside "
        f"{gb(sum(v for k, v in est.memory.items() if k != 'activations'))} of states")
    alpha, bw = cluster.link(t * d, ranks_per_node(t, d, cluster.gpus_per_node))   # dp ranks t apart
    sent = est.bytes_sent["dp"]
    ring = sent / bw                                  # the bandwidth term of the rings' time
    what = ("one ring all-reduce of the gradients", "a reduce-scatter of the gradients and an all-gather "
            "of the weights", "a reduce-scatter of the gradients per micro-batch and an all-gather of the "
            "weights", "per micro-batch, all-gathers of the weights (forward and backward) and a "
            "reduce-scatter of the gradients")[lay.zero]
    if d == 1:
        say("   DP: none (dp 1): no gradients to reduce.\n")
    else:
        say(textwrap.fill(
            f"DP (ZeRO {lay.zero}): {what}, over dp {d} on {bw / GB:.0f} GB/s: {gb(sent)} sent by a GPU of "
            f"stage {est.bytes_stage} (est.bytes_sent, plan.step_bytes: the engine's own count, which "
            f"the lessons' counters match to the byte), {ring:.2f} s on the wire; overlapped with the last "
            f"micro-batch's backward, {est.dp_s:.2f} s of it is exposed.", 96,
            initial_indent="   ", subsequent_indent="   ") + "\n")
    return ok_bubble, ok_flight, {"layout": est.as_dict(), "micro_batches": m, "bubble": str(frac),
                                  "bubble_simulated": str(sim.bubble), "in_flight": str(flight),
                                  "in_flight_simulated": str(sim_flight), "dp_ring_s": ring}


# ----------------------------------------------------------------------------- 5. the choice

def choice(ests, cluster, cap_gb):
    """The fastest layout under each cap (plan.choose.choose), held to the rule."""
    caps = [("the GPU's usable memory", cost.USABLE_MEMORY * cluster.gpu.memory_bytes), ("--cap-gb", cap_gb * GB)]
    say("5. The fastest layout under a memory cap (plan.choose.choose: fits when memory <= cap)")
    ok, out = True, []
    for what, cap in caps:
        got = choosing.choose(ests, cap)
        fits = [e for e in ests if e.memory_bytes_per_gpu <= cap]
        right = (got is None and not fits) or (got is not None and any(got is e for e in fits)
                                               and all(e.step_time_s >= got.step_time_s for e in fits))
        ok = ok and right
        text = "nothing fits" if got is None else (
            f"{layout_text(got.layout)}, {got.step_time_s:.2f} s, {gb(got.memory_bytes_per_gpu)}")
        say(f"   cap {gb(cap)} ({what}), {len(fits):,} of {len(ests):,} layouts fit:\n     {text}: "
            + ("it fits, and no layout that fits is faster" if right
               else "WRONG: it does not fit, or a layout that fits is faster, or one fits and none was chosen"))
        out.append({"cap_bytes": cap, "chosen": None if got is None else got.as_dict(), "fitting": len(fits),
                    "right": right})
    say("")
    return ok, out


# ----------------------------------------------------------------------------- 6. published runs

KINDS = {"step_s": ("seconds per step", 1, "{:.2f}"), "mfu": ("MFU, model FLOPs / peak", 100, "{:.1f}%"),
         "tflops_hardware": ("TFLOP/s per GPU, hardware FLOPs (the recomputed forward counted)", 1, "{:.1f}"),
         "tflops_model": ("TFLOP/s per GPU, model FLOPs", 1, "{:.1f}"),
         "tokens_s": ("tokens per second per GPU (no FLOP convention)", 1, "{:,.0f}")}


CP_MODEL = ("Context parallelism as the planner models it (plan.cost): each GPU holds s/cp tokens "
            "of every sequence, so its compute and activations are 1/cp of one sequence's, the causal "
            "work balanced by the 2 cp chunks; per layer it sends plan.context.cp_layer_bytes on the "
            "link of the tp x cp ranks (16 nodes here), exposed for the all-gather as Llama 3 says (exposed "
            "but small next to attention; here {cp:.1%} of the step), hidden for a ring behind the layer's "
            "attention as a causal kernel computes it, half the s x s scores (this project's choice), its "
            "3 (cp-1) ring steps per layer one latency each.")


def cp_share(row):
    """The exposed CP exchange's share of a row's step (the split's terms that add to it)."""
    split = row["split"]
    return split["cp_s"] / sum(v for k, v in split.items() if k != "elementwise_s")


def mean_worst(errs):
    errs = [abs(e) for e in errs if e is not None]
    return (sum(errs) / len(errs), max(errs)) if errs else (None, None)


def goals_text(what, mean, worst, goal_mean, goal_worst):
    """One verdict line: met, or "not met" (a figure of the cost model, not a check)."""
    met = mean <= goal_mean and worst <= goal_worst
    return met, (f"   {what}: mean |error| {mean:.1%} (goal <= {goal_mean:.0%}), worst {worst:.1%} "
                 f"(goal <= {goal_worst:.0%}): " + ("met" if met else "not met"))


def published_runs():
    say("6. The planner against published runs (plan.published): each row in the unit its source\n"
        "   reports; one matmul efficiency per GPU type, chosen by one rule over all of that type's\n"
        "   rows (the value that minimises the worst error, then the next worst: plan.cluster), never\n"
        "   one per row. 'held out' is the row predicted with the constants the same rule picks from\n"
        "   the OTHER sources' rows only (leave-one-source-out): the figure to trust on a new run")
    result = published.evaluate()
    groups = {}
    for r in result["rows"]:
        groups.setdefault((r["source"], r["kind"]), []).append(r)
    for (src, kind), rows in groups.items():
        what, k, form = KINDS[kind]
        say(f"   {src}: {what}")
        harness.table([[r["label"], form.format(r["predicted"] * k), form.format(r["published"] * k),
                        f"{100 * r['rel_error']:+.1f}%",
                        "-" if r["loso_error"] is None else f"{100 * r['loso_error']:+.1f}%",
                        gb(r["memory_bytes_per_gpu"]), "yes" if r["fits"] else "NO"] for r in rows],
                      ["row", "predicted", "published", "error", "held out", "memory", "fits"],
                      indent="     ")
        held_mean, held_worst = mean_worst(r["loso_error"] for r in rows)
        mean, worst = mean_worst(r["rel_error"] for r in rows)
        fitted = sorted({(r["loso_efficiency"], r["loso_fit_on"]) for r in rows if r["loso_efficiency"]})
        say(f"     this source's rows: held out mean |error| "
            + ("-" if held_mean is None else f"{held_mean:.1%}, worst {held_worst:.1%}")
            + f"; in sample {mean:.1%}, worst {worst:.1%}")
        say("     held out: efficiency " + ", ".join(
            f"{e:.2f} for {on}" if on != "other GPU types" else f"{e:.2f} from the other GPU types' rows"
            for e, on in fitted) + ", fitted to the other sources' rows" if fitted
            else "     cannot be held out: no other source has a row")
        if not all(r["fits"] for r in rows):
            say("     NO: by the planner's own memory count this layout does not fit (the note says why)")
        notes = [r["note"] for r in rows]
        for note in sorted(set(notes), key=notes.index):
            if note:
                say(textwrap.fill(f"({note})", 96, initial_indent="     ", subsequent_indent="      "))
        if any(r["cp"] > 1 for r in rows):
            share = max(cp_share(r) for r in rows if r["cp"] > 1)
            say(textwrap.fill(CP_MODEL.format(cp=share), 96, initial_indent="     ",
                              subsequent_indent="     "))
    n, sources = len(result["rows"]), result["sources"]
    say(f"   Over {n} rows from {sources} sources (the course asks for at least 25 from at least 6):")
    held_ok, line = goals_text("held out by source", result["loso_mean_abs_error"],
                               result["loso_worst_abs_error"], GOAL_HELD_MEAN, GOAL_HELD_WORST)
    say(line)
    in_ok, line = goals_text("in sample", result["mean_abs_error"], result["worst_abs_error"],
                             GOAL_MEAN, GOAL_WORST)
    say(line)
    say(textwrap.fill(
        "The goals are the cost model's, not this lesson's arithmetic: a goal not met is printed, "
        "not failed (the verdict below is the lesson's own checks). Where rows miss, their split "
        "(--json) shows the term to suspect. What is left is mostly compute: one efficiency per GPU "
        "type cannot serve both MT-NLG's 530B and Narayanan's run of the same shape (126 against "
        "163 TFLOP/s per GPU), nor on H100 MosaicML's 13B (predicted 17-19% fast) beside its 30B "
        "and 70B and Megatron's Mixtral 8x22B (up to 20% slow): held out, each pulls the "
        "constant the other way. The GEMM-shape and link-efficiency terms, tried, made the "
        "held-out error worse (docs/reference.md, The planner) and stay options.", 96,
        initial_indent="   ", subsequent_indent="   ") + "\n")
    result["goals"] = {"held_out": held_ok, "in_sample": in_ok}
    return result


# ----------------------------------------------------------------------------- 7. the time-scaled cluster

def measured(comm):
    """Lesson 07's layouts on this machine under the link model, beside the planner."""
    from minidist.lessons import plan_measure as measure
    say("7. The planner against a time-scaled cluster on this machine (minidist/comm/links.py;\n"
        "   minidist/lessons/plan_measure.py):\n"
        f"   lesson 07 at every tp x pp x dp of {comm.Get_size()} ranks, measured beside predicted")
    result = measure.run(comm)
    for line in measure.table(result):
        say(line)
    rho, top2 = result["spearman"], result["best_in_predicted_two"]
    rho_ok = rho is not None and rho >= GOAL_RHO
    same_bytes = result.get("bytes_match", False)
    ok = rho_ok and top2 and same_bytes
    say(f"   bytes: the planner's {'equal' if same_bytes else 'DIFFER from'} the counters'; rho "
        f"{'-' if rho is None else f'{rho:.2f}'} {'>=' if rho_ok else 'NOT >='} {GOAL_RHO}; the measured "
        f"best is {'' if top2 else 'NOT '}among\n   the predicted best two: "
        + ("the rankings agree" if ok else "they DISAGREE") + "\n")
    return ok, result


# ----------------------------------------------------------------------------- the story

def plan_story(args):
    model = layout.model_from_params(args.params)     # the input checked before any line is printed
    try:
        cluster = clusters.make_cluster(args.gpu, args.gpus)
    except ValueError as e:
        raise harness.InputError(f"--gpus {args.gpus}: {e}")
    ests = search.search(model, cluster, top=None)
    harness.need(ests and ests[0].fits, f"no layout of a {args.params:.3g}-parameter model fits "
                 f"{args.gpus} {args.gpu}: give more GPUs or a smaller --params")
    say(f"Lesson 12: planning a run of {args.params / 1e9:g}B parameters on {args.gpus} {args.gpu}\n")
    figures, checks = {}, {}
    figures["model_states"] = model_states()
    checks["zero_paper"], figures["zero_paper"] = zero_paper()
    best_layouts(model, cluster, ests)
    figures["tp"] = why_tp_8(model, cluster)
    seed = [e for e in ests if e.fits and e.layout.tp == min(8, cluster.gpus_per_node) and e.layout.pp == 8]
    piped = seed[0] if seed else next((e for e in ests if e.fits and e.layout.pp > 1), ests[0])
    checks["bubble"], checks["in_flight"], figures["costs"] = costs(model, cluster, piped, bool(seed))
    checks["choice"], figures["choice"] = choice(ests, cluster, args.cap_gb)
    layouts = [e.as_dict() for e in ests[:5]]
    pub = None
    if args.published:
        pub = published_runs()
        figures["published_goals"] = pub["goals"]
    return figures, checks, layouts, pub


def main(args):
    comm = harness.comm_world()
    world = comm.Get_size()
    if not args.measure:
        harness.single_process("lesson 12 (without --measure)")
    else:
        harness.need(world >= 8 and world % 4 == 0, f"--measure runs lesson 07 on simulated nodes of 4 ranks, "
                     f"at least two of them: {harness.command_with(8)}, not {harness.ranks(world)}")
    figures, checks, layouts, pub = plan_story(args)        # every rank alike (rank 0 prints)
    measure_result = None
    if args.measure:
        checks["measure"], measure_result = measured(comm)   # every rank gets the same result
    match = all(checks.values())
    figures["checks"] = checks
    report = harness.new_report("12_plan", args, parallel={"gpus": args.gpus, "gpu": args.gpu}, match=match,
                                figures=figures)
    report["layouts"] = layouts
    if pub is not None:
        report["published"] = pub
    if measure_result is not None:
        report["measured"], report["spearman"] = measure_result["measured"], measure_result["spearman"]
        figures["measure"] = {k: v for k, v in measure_result.items() if k not in ("measured", "spearman")}
    say("checks: " + ", ".join(f"{k} {'held' if v else 'NOT HELD'}" for k, v in checks.items()))
    if pub is not None:
        say("published goals (the cost model's, printed, not checked): " + ", ".join(
            f"{k.replace('_', ' ')} {'met' if v else 'not met'}" for k, v in pub["goals"].items()))
    return harness.finish(report, args)


if __name__ == "__main__":
    harness.run(main, build_parser())
