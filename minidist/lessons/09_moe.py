"""Lesson 09: mixture of experts and expert parallelism. A router sends each token to top_k
of E expert MLPs; the experts are spread over the ranks and the tokens travel to them and
back with all-to-all. The run must equal one process routing the same groups.

    mpirun -n 4 python -m minidist.lessons.09_moe
    mpirun -n 4 python -m minidist.lessons.09_moe --experts 8 --top-k 2 --json out.json
    mpirun -n 4 python -m minidist.lessons.09_moe --top-k 1 --capacity-factor 1.0
    mpirun -n 3 python -m minidist.lessons.09_moe --experts 6 --capacity-factor none
    mpirun -n 4 python -m minidist.lessons.09_moe --ep 2 --moe-every 1
    mpirun -n 4 python -m minidist.lessons.09_moe --drop-policy probs --pad-to-capacity

Every rank builds the same MoE GPT (minidist/moe.py) from --seed and keeps E/ep experts
of each MoE layer (minidist/parallel/expert_parallel.py); each rank's rows of the global
batch are one routing group, so the single-process reference trains the whole batch with
moe_groups = the number of ranks. Compared: the loss of every step (cross-entropy plus
the balance and z losses), the raw gradients of every step (dense ones averaged over the
ranks, each expert's over the ranks that hold it; before clipping and AdamW) against the
reference's, each rank's expert slice against the same slice, and the weights. Printed:
the expert load table per step (tokens each expert processed, summed over ranks, and the
dropped choices) beside the reference's, the all-to-all bytes each rank sent measured
beside 2 x (rows out + rows in) x C x bytes (with --pad-to-capacity: beside 4 x (N-1)/N
x E x capacity x C x bytes per MoE block), parameters in total and active per token,
and FLOPs per token (6N + 12LHQT, N the active parameters) beside dense models.
"""
import argparse
import dataclasses
import math
from types import SimpleNamespace

import numpy as np

from minidist.comm import stats
from minidist.lessons import common, harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.model import GPT
from minidist.moe import DROP_POLICIES, expert_capacity, set_drop_policy
from minidist.parallel.expert_parallel import expert_parallel
from minidist.plan.flops import flops_per_token
from minidist.plan.traffic import moe_bytes, moe_padded_sent, moe_sent
from minidist.train import TrainConfig

A2A = "all_to_all"          # the counter the dispatch and combine rows are counted under


def capacity_factor(text):
    """argparse type: a number, or "none" for dropless routing (checked in check_input)."""
    if text.strip().lower() in ("none", "dropless"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number or none, got {text!r}")
    return v


def check_input(args, cfg, world):
    """Every rank finds the same answer: bad input ends the job with one message, exit 2,
    and on the next line a command that works (every flag that cannot work changed at once).
    Returns (ep, E)."""
    ep = args.ep or world
    cf, k = args.capacity_factor, args.top_k
    fix, ep_ok = {}, world % ep == 0                    # the flags to change, and to what
    if not ep_ok:
        fix["--ep"] = ep = world
    experts = args.experts if args.experts is not None else 2 * ep
    if experts % ep:
        fix["--experts"] = experts = max(ep, round(experts / ep) * ep)
    if k not in (1, 2) or k > experts:
        fix["--top-k"] = min(2, experts)
    if (cf is not None and cf <= 0) or (cf is None and args.pad_to_capacity):
        fix["--capacity-factor"] = 1.25
    if args.moe_every > cfg.n_layer:
        fix["--moe-every"] = cfg.n_layer
    if args.batch_size % world:
        fix["--batch-size"] = -(-args.batch_size // world) * world
    works = f"\n  this works: {harness.command_with(world, fix)}"   # its own line: 100 columns
    harness.need(ep_ok, f"--ep {args.ep} must divide the {world} ranks: the expert-parallel groups are "
                        f"carved out of them" + works)
    harness.need("--experts" not in fix, f"--experts {args.experts} does not split evenly over the {ep} "
                                         f"ranks of an expert-parallel group" + works)
    harness.need(k in (1, 2), f"--top-k {k}: this MoE routes each token to 1 expert (Switch) or 2 (GShard)"
                 + works)
    harness.need(k <= experts, f"--top-k {k} is more than the {experts} experts: a token picks k "
                               f"different ones" + works)
    harness.need(cf is not None or not args.pad_to_capacity,
                 "--pad-to-capacity needs a capacity; --capacity-factor none (dropless) has none"
                 + works)
    harness.need("--capacity-factor" not in fix, f"--capacity-factor {cf if cf is None else f'{cf:g}'}: must "
                                                 f"be above 0 (1.0 to 1.25 as in Switch), or none" + works)
    harness.need("--moe-every" not in fix, f"--moe-every {args.moe_every} with {cfg.n_layer} layers makes no "
                                           f"block an MoE block" + works)
    harness.need("--batch-size" not in fix, f"--batch-size {args.batch_size} does not divide among {world} "
                                            f"ranks (each rank's rows are one routing group)" + works)
    return ep, experts


def make_run(args, cfg):
    """A fresh model from --seed, its optimizer, and the schedule (optimizer built after
    any change to the model's parameters: expert parallelism makes new ones)."""
    tc = TrainConfig(batch_size=args.batch_size, max_iters=args.steps, learning_rate=args.lr,
                     min_lr=args.lr / 10, warmup_iters=1, grad_clip=args.grad_clip, seed=args.seed)
    return set_drop_policy(GPT(cfg, seed=args.seed), args.drop_policy), tc


def optimizer(model, tc):
    return model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))


def record(model):
    """Log, for every forward of `model` (one per step here), each MoE layer's load and the
    communication counters at the forward's start: [(counters, {layer: (tokens, dropped)})]."""
    log = []

    def pre(module, args):
        log.append([stats.snapshot(), None])

    def post(module, args, out):        # host numbers only: nothing read back from the device
        log[-1][1] = {i: (np.asarray(m.aux["tokens_per_expert"], np.int64), int(m.aux["dropped"]))
                      for i, m in module.moe_layers() if m.aux is not None}

    model.register_forward_hooks(pre, post)
    return log


def step_bytes(log, name=A2A):
    """Bytes sent under `name` in each step: the counters between one forward's start and the next."""
    marks = [snap for snap, _ in log] + [stats.snapshot()]
    return [stats.diff(b, a).get(name, {}).get("bytes_sent", 0) for a, b in zip(marks, marks[1:])]


def a2a_formula(loads, owner, rank, ep_ranks, row_bytes):
    """Bytes rank `rank` sends in one MoE layer's four all-to-alls, from the routing alone:
    dispatch forward and combine backward carry the rows it sends to other ranks' experts,
    combine forward and dispatch backward the rows other ranks send to its experts:
    2 x (rows out + rows in) x C x bytes per value. loads: {rank: tokens per expert (E,)}."""
    out = sum(int(loads[rank][e]) for e in range(len(owner)) if owner[e] != rank)
    into = sum(int(loads[s][e]) for s in ep_ranks if s != rank for e in range(len(owner)) if owner[e] == rank)
    return moe_sent(out, into, 1, row_bytes), out, into


def parameter_counts(model, cfg):
    """(total, active per token, router, one expert's) parameters, the position table left
    out as lesson 00 counts N; active: every dense parameter, the routers, top_k experts."""
    total = model.get_num_params()
    router = expert = 0
    inactive = 0
    for _, m in model.moe_layers():
        router += m.router.weight.size
        one = sum(p.size for p in (*m.c_fc.parameters(), *m.c_proj.parameters())) // m.n_expert
        expert = one
        inactive += (m.n_expert - m.top_k) * one
    return total, total - inactive, router, expert


def load_table(steps, ref_loads, par_loads, layers, E, tokens, top_k):
    """The load table: per step and MoE layer, tokens each expert processed (all ranks) and
    the dropped choices; a mark where the parallel run's differs from the reference's."""
    show = E <= 12
    header = ["step", "block", *([f"e{e}" for e in range(E)] if show else ["min", "mean", "max"]),
              "dropped", "same"]
    rows = []
    for s in range(steps):
        for i in layers:
            t, d = par_loads[s][i]
            rt, rd = ref_loads[s][i]
            same = bool(np.array_equal(t, rt) and d == rd)
            cells = [str(int(v)) for v in t] if show else [str(int(t.min())), f"{t.mean():.1f}", str(int(t.max()))]
            rows.append([s, i, *cells, d, "yes" if same else "NO"])
    say(f"\nexpert load: choices each expert processed, summed over the ranks, per step and MoE block;\n"
        f"each row sums with its dropped choices to top_k x tokens = {top_k} x {tokens:,} = {top_k * tokens:,}; "
        f"same:\nthe reference's table, routed in the same groups, is the same")
    harness.table(rows, header=header)


# ------------------------------------------------------------------------------------- 1. the setup

def setup(args):
    """The input checked, the MoE model's configuration built, the run described: the lesson's
    state, which the sections below read and add to."""
    comm = harness.comm_world()
    rank, world = comm.Get_rank(), comm.Get_size()
    args.grad_accum = 1
    base = common.config_from_args(args, world)
    ep, E = check_input(args, base, world)
    cfg = dataclasses.replace(base, n_expert=E, top_k=args.top_k, capacity_factor=args.capacity_factor,
                              moe_every=args.moe_every, moe_groups=world, moe_alpha=args.alpha,
                              moe_z=args.z_loss)
    try:
        cfg.validate()
    except ValueError as e:
        raise harness.InputError(str(e))
    rows = common.batch_rows(args, rank, world)
    data = common.load_dataset(args, comm)
    item = np.dtype(cfg.dtype).itemsize
    per_rank_rows = args.batch_size // world
    group = per_rank_rows * cfg.block_size                     # tokens in one routing group
    tokens = args.batch_size * cfg.block_size
    cap = expert_capacity(group, cfg.top_k, E, cfg.capacity_factor)
    outer = world // ep
    say(f"Lesson 09: mixture of experts on {harness.ranks(world)}, expert parallelism over {ep} "
        f"({E // ep} of {E} experts each)" + (f",\n{outer} copies of each expert" if outer > 1 else "") + "\n")
    say(f"model   n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size} "
        f"dropout={cfg.dropout} {cfg.dtype}")
    moe_blocks = [i for i in range(cfg.n_layer) if cfg.is_moe(i)]
    say(f"MoE     blocks {moe_blocks} (every {cfg.moe_every}): {E} experts, top-{cfg.top_k}"
        + (", gates renormalised over the 2 (GShard)" if cfg.top_k == 2 else ", gate = probability (Switch)"))
    say("        capacity " + (f"factor {cfg.capacity_factor:g}: ceil({group} x {cfg.top_k} / {E} x "
                                f"{cfg.capacity_factor:g}) = {cap} choices per expert and group"
                                if cap is not None else "none: dropless, every choice kept"))
    if cap is not None:
        probs = ("probs, after Megatron-Core's --moe-token-drop-policy probs: each expert keeps\n"
                 "        its most probable choices, ties to the lower token index; ranked here by the\n"
                 "        router's softmax probability (Megatron's ranking with --moe-router-pre-softmax;\n"
                 "        by default Megatron ranks by the renormalised top-k weight)")
        say("        drop policy " + ("position: GShard's order, every first choice in token order, then every\n"
                                     "        second choice (Switch's cumulative order for top-1)"
                                     if args.drop_policy == "position" else probs))
    say("        all-to-all " + ("padded: every expert's rows padded to the capacity, a fixed (E, capacity, C)"
                                 if args.pad_to_capacity else "variable size: the kept rows only"))
    say(f"        balance loss alpha {cfg.moe_alpha:g} x E x sum f_i P_i, z-loss {cfg.moe_z:g}")
    say(f"batch   global {args.batch_size} sequences = {harness.ranks(world)} x {per_rank_rows}: each rank's "
        f"{group} tokens one routing group")
    say(f"steps   {args.steps} AdamW steps, " + (f"gradient clipping at norm {args.grad_clip}" if args.grad_clip
                                                  else "no gradient clipping"))
    return SimpleNamespace(args=args, comm=comm, rank=rank, world=world, cfg=cfg, ep=ep, E=E, rows=rows,
                           data=data, item=item, group=group, tokens=tokens, cap=cap, moe_blocks=moe_blocks)


# ----------------------------------------------------------------------- 2. the expert-parallel run

def expert_parallel_run(run):
    """The same full model on every rank, then each keeps its experts; trained, its loads and
    all-to-all bytes logged step by step."""
    args, comm, rank, world = run.args, run.comm, run.rank, run.world
    run.model, run.tc = model, tc = make_run(args, run.cfg)
    run.ep_comm = comm.Split(color=rank // run.ep, key=rank)   # ranks [g ep, (g+1) ep): one group of experts
    run.dp = expert_parallel(model, run.ep_comm, comm, pad_to_capacity=args.pad_to_capacity)
    opt = optimizer(model, tc)
    log = record(model)
    losses, run.state, run.times = common.train_and_collect(model, opt, run.data, args, tc, run.rows, 1, run.dp)
    run.a2a_steps = step_bytes(log)
    run.losses = list(common.mpi_reduce(comm, losses, "sum") / world)
    # the loads of every rank's group, for the table and the formula (the report's own message)
    run.every = every = comm.allgather([loads for _, loads in log])   # [rank][step] {layer: (tokens, dropped)}
    run.par_loads = [{i: (sum(every[r][s][i][0] for r in range(world)),
                          sum(every[r][s][i][1] for r in range(world)))
                      for i in run.moe_blocks} for s in range(args.steps)]


# ------------------------------------------------------------------------- 3. one process, compared

def reference_run(run):
    """The reference: one process, the whole global batch in `world` routing groups."""
    run.ref_model, _ = make_run(run.args, run.cfg)
    ref_opt = optimizer(run.ref_model, run.tc)
    ref_log = record(run.ref_model)
    run.ref_losses, run.ref_full, _ = common.train_and_collect(run.ref_model, ref_opt, run.data, run.args, run.tc)
    run.ref_loads = [loads for _, loads in ref_log]


def compare_section(run):
    """Each rank's pieces against the same pieces of the reference (its experts [lo, hi)), the
    losses, and the load tables step by step."""
    args, comm, state, ref_full, cfg = run.args, run.comm, run.state, run.ref_full, run.cfg
    slices = {f"transformer.h.{i}.mlp.{n}": slice(m.lo, m.hi) for i, m in run.dp.layers
              for n in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")}

    def piece(key):
        name = key.split(":", 1)[1].split("@", 1)[0]
        return ref_full[key][slices[name]] if name in slices else ref_full[key]

    ref_state = {k: piece(k) for k in state}
    state["loss"], ref_state["loss"] = np.array(run.losses), np.array(run.ref_losses)
    rel, abs_diff, _ = harness.compare(state, ref_state)
    run.rel, run.abs_diff = common.mpi_reduce(comm, [rel, abs_diff])
    run.tol = tol = harness.TOLERANCE[cfg.dtype]
    par_loads, ref_loads = run.par_loads, run.ref_loads
    run.loads_same = all(np.array_equal(par_loads[s][i][0], ref_loads[s][i][0])
                         and par_loads[s][i][1] == ref_loads[s][i][1]
                         for s in range(args.steps) for i in run.moe_blocks)
    common.report_comparison(comm, harness.ranks(run.world), run.ref_losses, run.losses, state, ref_state, tol,
                             notes=("expert weights and gradients: each rank's experts [lo, hi) against the same "
                                    "slice of the\n    reference's stacked (E, ...) tensors; the loss is "
                                    "cross-entropy + balance + z losses",))
    say(f"  tolerance {tol:.0e} ({cfg.dtype}) per tensor: {'all within' if run.rel <= tol else 'OUTSIDE'}")


# ------------------------------------------------------------------------------- 4. the expert load

def load_section(run):
    """The load table beside the reference's, and the dropped choices."""
    args, cap = run.args, run.cap
    load_table(args.steps, run.ref_loads, run.par_loads, run.moe_blocks, run.E, run.tokens, run.cfg.top_k)
    run.dropped = [[int(run.par_loads[s][i][1]) for i in run.moe_blocks] for s in range(args.steps)]
    say("  dropped choices pass the MoE block through the residual only"
        + (" (none: dropless)" if cap is None else f" (capacity {cap} per expert and group)"))


# ------------------------------------------------------------------------------ 5. all-to-all bytes

def a2a_section(run):
    """The all-to-all bytes each rank sent per step, measured beside the formula from the
    routing (with --pad-to-capacity, beside the padded formula)."""
    args, comm, cfg, ep, E, item, cap = run.args, run.comm, run.cfg, run.ep, run.E, run.item, run.cap
    rank, world, every, moe_blocks = run.rank, run.world, run.every, run.moe_blocks
    owner = [e // (E // ep) for e in range(E)]
    me, group_ranks = run.ep_comm.Get_rank(), [(rank // ep) * ep + r for r in range(ep)]
    row_bytes = cfg.n_embd * item
    formula, outs, ins = [], [], []
    for s in range(args.steps):
        f_s = o_s = i_s = 0
        for i in moe_blocks:
            loads = {r - group_ranks[0]: every[r][s][i][0] for r in group_ranks}
            f, o, n_in = a2a_formula(loads, owner, me, range(ep), row_bytes)
            f_s, o_s, i_s = f_s + f, o_s + o, i_s + n_in
        formula.append(f_s), outs.append(o_s), ins.append(i_s)
    run.all_meas = all_meas = comm.allgather(run.a2a_steps)
    all_form = comm.allgather(formula)
    all_rows = comm.allgather((outs, ins))
    run.nb = nb = len(moe_blocks)
    run.padded = padded = 4 * nb * moe_padded_sent(E, cap, cfg.n_embd, ep, item) if args.pad_to_capacity else None
    say(f"\nall-to-all bytes per step, per rank ({nb} MoE block{'s' * (nb > 1)} x 4 "
        f"all-to-alls: dispatch and combine,\nforward and backward). Variable size: "
        f"2 x (rows out + rows in) x C x {item} B, rows out = my tokens'\n"
        f"kept choices for other ranks' experts, rows in = theirs for mine")
    if padded is not None:
        say(f"Padded (sent here): 4 x (N-1)/N x E x capacity x C x {item} B per MoE block, whatever the\n"
            f"routing: 4 x {ep - 1}/{ep} x {E} x {cap} x {cfg.n_embd} x {item} B x {nb} MoE "
            f"block{'s' * (nb > 1)} = {padded:,} B per rank and step")
    table = []
    for s in range(args.steps):
        for r in range(world):
            o, n_in = all_rows[r][0][s], all_rows[r][1][s]
            m, f = all_meas[r][s], all_form[r][s] if padded is None else padded
            var = [] if padded is None else [f"{all_form[r][s]:,}"]
            table.append([s, r, o, n_in, *var, f"{m:,}", f"{f:,}", "equal" if m == f else "DIFFERS"])
    harness.table(table, header=["step", "rank", "rows out", "rows in", *(["variable B"] if padded else []),
                                 "measured B", "padded B" if padded else "formula B", "check"])
    run.variable_total = variable_total = max(sum(f) for f in all_form)
    if padded is not None:
        all_form = [[padded] * args.steps for _ in range(world)]
    run.all_form = all_form
    run.a2a_equal = a2a_equal = all(all_meas[r][s] == all_form[r][s] for r in range(world) for s in range(args.steps))
    run.meas_total = meas_total = max(sum(m) for m in all_meas)
    run.form_total = form_total = max(sum(f) for f in all_form)
    say(f"  over the run, the busiest rank: measured {meas_total:,} B, formula {form_total:,} B"
        + ("  equal" if meas_total == form_total and a2a_equal else "  DIFFERS"))
    if padded is not None and variable_total:
        say(f"  the variable-size dispatch would have sent {variable_total:,} B: padding costs "
            f"{meas_total / variable_total:.2f}x")
    say(f"  uniform routing would send about 4 k (N-1)/N x {run.group} tokens x C x {item} B per MoE block,\n"
        f"  x {nb} MoE block{'s' * (nb > 1)} = "
        f"{fmt_bytes(moe_bytes(run.group, cfg.top_k, cfg.n_embd, ep, item) * nb)} per rank and step")


# -------------------------------------------------------------------------- 6. parameters and FLOPs

def params_flops_section(run):
    """Parameters in total, active per token and held per rank; FLOPs per token beside dense
    models."""
    cfg, comm, E, ep, nb, model = run.cfg, run.comm, run.E, run.ep, run.nb, run.model
    total, active, router, one = parameter_counts(run.ref_model, cfg)
    L, H, T = cfg.n_layer, cfg.n_head, cfg.block_size
    run.fpt = fpt = lambda n: flops_per_token(L, H, cfg.n_embd // H, T, n)   # noqa: E731  6N + 12LHQT
    run.dense_active = dense_active = active - router
    run.held = held = sum(p.size for p in model.parameters()) - model.transformer.wpe.weight.size
    run.total, run.active = total, active
    say("\nparameters (the position table left out, as lesson 00 counts N)")
    say(f"  total             {total:>10,}  every expert: {nb} MoE block{'s' * (nb > 1)} x {E} experts x {one:,}")
    say(f"  active per token  {active:>10,}  dense + routers ({router:,}) + {cfg.top_k} expert{'s' * (cfg.top_k > 1)}"
        f" per MoE block")
    say(f"  held per rank     {int(common.mpi_reduce(comm, held)):>10,}  dense + {E // ep} expert"
        f"{'s' * (E // ep > 1)} per MoE block (the most of any rank)")
    say("\ntraining FLOPs per token = 6N + 12LHQT (lesson 00's rule; N = parameters a token uses)")
    harness.table([
        ["this MoE model", f"{active:,}", f"{fpt(active) / 1e6:.2f}"],
        [f"dense, MLPs {cfg.top_k} x wide (same active)", f"{dense_active:,}", f"{fpt(dense_active) / 1e6:.2f}"],
        ["dense, all parameters active", f"{total:,}", f"{fpt(total) / 1e6:.2f}"],
    ], header=["model", "N", "MFLOP/token"])
    say(f"  the MoE model holds {total / dense_active:.2f}x the parameters of the dense model with its FLOPs;\n"
        f"  its extra FLOPs are the routers' 6 x {router:,} (and, uncounted, the all-to-alls' time)")


# ------------------------------------------------------------------------------------ 7. the report

def report_section(run):
    """The step time, the figures and the verdict."""
    args, comm, cfg, fpt, padded = run.args, run.comm, run.cfg, run.fpt, run.padded
    step_time = common.mpi_reduce(comm, float(np.median(run.times)))
    match = bool(run.rel <= run.tol and run.a2a_equal and run.loads_same)
    tpe = [[[int(v) for v in run.par_loads[s][i][0]] for i in run.moe_blocks] for s in range(args.steps)]
    figures = {"a2a_bytes_measured": run.meas_total, "a2a_bytes_formula": run.form_total,
               "a2a_bytes_variable_formula": run.variable_total,
               "a2a_bytes_padded_formula": padded * args.steps if padded is not None else -1,
               "dropped_tokens_total": sum(map(sum, run.dropped)), "tokens_per_step": run.tokens,
               "routed_choices_per_step_and_layer": cfg.top_k * run.tokens,
               "capacity": run.cap if run.cap is not None else -1,
               "params_total": run.total, "params_active_per_token": run.active,
               "params_per_rank": int(common.mpi_reduce(comm, run.held)),
               "flops_per_token_moe": fpt(run.active), "flops_per_token_dense_same_active": fpt(run.dense_active),
               "flops_per_token_dense_same_total": fpt(run.total)}
    report = harness.new_report(
        "09_moe", args, parallel={"dp": run.world, "ep": run.ep, "tp": 1, "pp": 1, "experts": run.E,
                                  "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
                                  "moe_every": cfg.moe_every, "drop_policy": args.drop_policy,
                                  "pad_to_capacity": args.pad_to_capacity},
        match=match, max_rel_diff=run.rel, max_abs_diff=run.abs_diff, tolerance=run.tol,
        losses={"reference": run.ref_losses, "parallel": run.losses},
        comm={"bytes_sent": {A2A: max(m[0] for m in run.all_meas)},
              "expected_bytes": {A2A: max(f[0] for f in run.all_form)}},
        step_time_s=step_time, figures=figures)
    report["moe_layers"] = run.moe_blocks
    report["tokens_per_expert"] = tpe           # [step][MoE block][expert], summed over ranks
    report["dropped_tokens"] = run.dropped      # [step][MoE block]
    if not run.a2a_equal:
        say("\nthe all-to-all bytes DIFFER from the formula")
    if not run.loads_same:
        say("\nthe load table DIFFERS from the reference's: the groups were not routed alike")
    return report


def main(args):
    run = setup(args)
    expert_parallel_run(run)
    reference_run(run)
    compare_section(run)
    load_section(run)
    a2a_section(run)
    params_flops_section(run)
    return harness.finish(report_section(run), args)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=3, dtype="float64")
    common.add_model_flags(p, n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=12)
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--experts", type=harness.positive_int, default=None,
                   help="experts per MoE block (default: 2 x the expert-parallel size, 8 at -n 4)")
    g.add_argument("--top-k", type=harness.positive_int, default=2, help="experts per token, 1 or 2 (default 2)")
    g.add_argument("--capacity-factor", type=capacity_factor, default=1.25, metavar="F",
                   help="capacity = ceil(tokens x k / E x F) per expert and group; none: dropless (default 1.25)")
    g.add_argument("--moe-every", type=harness.positive_int, default=2,
                   help="every k-th block is an MoE block (default 2: blocks 1, 3, ...)")
    g.add_argument("--alpha", type=harness.nonnegative_float, default=0.01, help="balance loss coefficient (0.01)")
    g.add_argument("--z-loss", type=harness.nonnegative_float, default=0.0, help="router z-loss coefficient (0)")
    g.add_argument("--drop-policy", choices=DROP_POLICIES, default="position",
                   help="which choices an expert over capacity drops: position (GShard's order, the "
                        "default) or probs (the lowest softmax probabilities; after Megatron-Core's "
                        "--moe-token-drop-policy probs, ranked as with --moe-router-pre-softmax)")
    g.add_argument("--pad-to-capacity", action="store_true",
                   help="send every expert's rows padded to the capacity (GShard, DeepSpeed-MoE): "
                        "fixed bytes")
    g.add_argument("--ep", type=harness.positive_int, default=None,
                   help="expert-parallel group size (default: every rank); it must divide the ranks")
    common.add_step_flags(p)
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
