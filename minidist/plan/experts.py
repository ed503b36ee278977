"""Mixture of experts in the planner: a model's experts, a layout's expert parallelism, and
what they add to a dense estimate (plan.cost). Over 400 lines but one idea: every term the
planner adds for experts (parameters, FLOPs, all-to-all bytes and time, expert state, the
estimate and its search) in one place, plain arithmetic.

    python -c "from minidist.plan.experts import *; print(MIXTRAL_8X7B_EXPERTS)"

An MoE layer replaces the MLP by E experts (each an MLP of width f_e) and a router (an h x E
matrix) that sends each token to its top_k experts (Shazeer et al. 2017; GShard, Lepikhin
et al. 2020, section 2.2; Mixtral: E 8, top_k 2, every layer). What the planner counts:
  parameters  total: every expert, E f_e-wide MLPs per MoE layer; active (per token): top_k
              of them. FLOPs follow the active count, memory holds the total.
  FLOPs       one MoE layer's forward is a dense layer's of MLP width top_k f_e (each token
              through top_k experts) plus the router's 2 b s h E; with a capacity factor
              c (GShard's drop-and-pad: each expert takes at most c k T / E tokens, padded
              to it) the experts' hardware FLOPs are c times that, the model FLOPs not.
  expert parallelism (ep)  each of ep ranks holds E/ep experts. Megatron-LM's rank order
              is tp-cp-ep-dp-pp (megatron/core/parallel_state.py, its default order
              string): EP inside the data-parallel group, ep ranks tp x cp apart, so an EP
              group spans tp x cp x ep consecutive ranks (one node when that is <= 8).
              Expert tensors are cut over tp too (Megatron-LM's --expert-tensor-parallel-size
              defaults to the tensor-parallel size) and their gradients reduced over the
              dp x cp / ep ranks holding the same experts (the expert-data-parallel group).
  expert TP (etp)  MoE Parallel Folding (Liu et al. 2025, arXiv 2504.14960; Megatron-LM's
              --expert-tensor-parallel-size): the experts get their own tensor-parallel
              size, their ranks ordered etp-ep-edp-pp over the same tp x cp x dp ranks of
              a stage, so an EP group spans etp x ep consecutive ranks (ETP 1, EP 8: one
              node, where TP 2 x EP 8 would cross two) and each expert's gradients are
              reduced over the edp = tp cp dp / (etp ep) ranks holding it. etp=None keeps
              the coupled mapping above (expert TP = TP). The experts' FLOPs per GPU do
              not change (a rank computes full-width experts for its own b s / (cp tp)
              tokens instead of a 1/tp slice for the TP group's), so the dense
              equivalent's compute stands; what changes is the MLP half of each MoE
              layer's TP messages (sequence parallelism: 2 all-gathers, 2 reduce-scatters
              and a repeated all-gather of a layer's 4 + 4 + 2; plan.traffic.tp_sent):
              they run over etp ranks instead of tp, none at etp 1, and are exposed whole
              (this project's choice: --tp-comm-overlap is taken to cover the attention's,
              not the dispatcher's gathers); expert_tp_seconds is that difference, never
              taking more than the dense TP time off. The bubble keeps the dense
              equivalent's TP time (this project's simplification). Megatron-LM's README
              (megatron/core/transformer/moe/README.md, "MoE Parallel Folding") describes
              the two rank generators.
  all-to-all  per MoE layer and micro-batch, 4 all-to-alls (dispatch, combine; forward,
              backward) of the (ep-1)/ep of a rank's routed rows that leave it:
              plan.traffic.moe_bytes, the count this engine's expert parallelism sends
              under even routing (plan.traffic.moe_sent, tests/mpi), times c under a
              capacity factor. A rank routes its b s / cp tokens, / t of them under
              sequence parallelism (each TP rank dispatches its own slice: this project's
              count; with folding, each rank of the attention's TP group too). Timed as
              ring steps (ep - 1 per call) x alpha + bytes / bandwidth on the EP group's
              link, exposed whole (this project's choice: no overlap with compute, which
              Megatron-LM's --overlap-moe-expert-parallel-comm can add).

estimate_moe(model, experts, cluster, layout, ep, etp=None) is this layering: the dense
estimate of the same model with the MLP width that does the experts' work (top_k f_e x c
in an MoE layer, averaged over the layers: the active FLOPs, the routed tokens'
activations), plus the exposed all-to-all and the expert-TP difference, plus what the
experts a GPU holds add beyond the dense equivalent's MLPs (either sign): their model
states, sharded by ZeRO over the expert-data-parallel group, and their ZeRO traffic over
it (expert_dp_seconds: the difference timed whole on the data-parallel link, never taking
more than the dense DP time off; this project's choice). search_moe runs plan.search's
layouts of the dense equivalent with every legal ep (etp coupled). Not modelled: load
imbalance beyond the capacity factor, grouped-GEMM efficiency and the expert GEMMs' shapes
under etp (plan.gemm), the all-to-all's share of the pipeline bubble.
"""
from dataclasses import dataclass, replace

from minidist.plan import gemm as G
from minidist.plan.cost import TP_OVERLAP_SM_SHARE, USABLE_MEMORY, estimate
from minidist.plan.flops import layer_flops, step_flops
from minidist.plan.layout import Layout, layout_stages, legal
from minidist.plan.memory import ACCOUNTING, model_state_bytes
from minidist.plan.search import layouts
from minidist.plan.step_bytes import seconds as collective_seconds
from minidist.plan.traffic import moe_bytes, tp_sent


@dataclass(frozen=True)
class Experts:
    experts: int                     # E
    top_k: int = 2
    expert_ffn: int = None           # f_e; None: the model's MLP width
    every: int = 1                   # one MoE layer every `every` layers (1: all of them)
    capacity_factor: float = None    # None: dropless (every routed row computed, none padded)


MIXTRAL_8X7B_EXPERTS = Experts(8, 2)   # Mixtral 8x7B: 8 experts of Mistral 7B's MLP, top 2


def expert_ffn(model, moe):
    return model.ffn if moe.expert_ffn is None else moe.expert_ffn


def moe_layers(model, moe):
    """MoE layers of the model: one every `every` layers."""
    return model.layers // moe.every


def expert_params(model, moe):
    """Parameters of one expert: Llama's three h x f_e matrices (SwiGLU), GPT's two and
    their biases."""
    h, f = model.hidden, expert_ffn(model, moe)
    return 3 * h * f if model.swiglu else 2 * h * f + f + h


def _dense_mlp(model):
    h, f = model.hidden, model.ffn
    return 3 * h * f if model.swiglu else 2 * h * f + f + h


def params(model, moe, active=False):
    """All parameters (active=False) or those one token uses (active=True): the dense
    model's, each MoE layer's MLP replaced by E (or top_k) experts and a router, h x E.
    Mixtral 8x7B (32 layers, h 4096, f 14336, 32000 words): 46.7B total, 12.9B active."""
    n = moe.top_k if active else moe.experts
    per = n * expert_params(model, moe) + model.hidden * moe.experts - _dense_mlp(model)
    return model.params() + moe_layers(model, moe) * per


def legal_moe(model, moe, layout, ep, etp=None):
    """None when the experts, ep and etp (None: the layout's tp, coupled) fit the layout,
    else a one-line reason."""
    if moe.experts < 1 or not 1 <= moe.top_k <= moe.experts:
        return f"top-k {moe.top_k} must be between 1 and the {moe.experts} experts"
    if moe.every < 1 or model.layers % moe.every:
        return f"one MoE layer every {moe.every} layers does not divide the {model.layers} layers"
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        return f"the capacity factor must be positive, not {moe.capacity_factor}"
    if ep < 1 or moe.experts % ep:
        return f"ep {ep} does not divide the {moe.experts} experts"
    if etp is None:
        if (layout.dp * layout.cp) % ep:
            return (f"ep {ep} must divide dp x cp = {layout.dp * layout.cp} (EP lies inside the "
                    "data-parallel group, Megatron-LM's tp-cp-ep-dp-pp order)")
        if expert_ffn(model, moe) % layout.tp:
            return f"tp {layout.tp} does not divide the expert width {expert_ffn(model, moe)}"
        return None
    stage = layout.tp * layout.cp * layout.dp
    if etp < 1 or stage % (etp * ep):
        return (f"etp x ep = {etp} x {ep} must divide tp x cp x dp = {stage} (MoE Parallel "
                "Folding: the experts' etp-ep-edp-pp ranks are a stage's)")
    if expert_ffn(model, moe) % etp:
        return f"etp {etp} does not divide the expert width {expert_ffn(model, moe)}"
    if layout.tp > 1 and not layout.sequence_parallel:
        return "expert TP apart from TP needs sequence parallelism (each TP rank routes its own tokens)"
    return None


def all_to_all_bytes(model, moe, layout, ep, layers):
    """Bytes one GPU sends in one step's all-to-alls over `layers` of its stage's layers:
    per MoE layer and micro-batch plan.traffic.moe_bytes of its routed tokens (docstring),
    times the capacity factor, in the activations' itemsize."""
    if ep == 1:
        return 0.0
    m = model.global_batch // (layout.dp * layout.micro_batch)
    tokens = layout.micro_batch * model.seq / layout.cp
    if layout.sequence_parallel:
        tokens /= layout.tp
    per = moe_bytes(tokens, moe.top_k, model.hidden, ep, ACCOUNTING[layout.precision][0])
    n_moe = layers // moe.every
    return m * n_moe * per * (moe.capacity_factor or 1)


def all_to_all_seconds(model, moe, cluster, layout, ep, layers, etp=None):
    """Alpha-beta time of those all-to-alls: 4 calls per MoE layer and micro-batch, ep - 1
    steps each, on the link of the tp x cp x ep ranks an EP group spans (folded, etp given:
    etp x ep)."""
    if ep == 1:
        return 0.0
    alpha, bw = cluster.link(layout.tp * layout.cp * ep if etp is None else etp * ep)
    m = model.global_batch // (layout.dp * layout.micro_batch)
    calls = 4 * m * (layers // moe.every)
    return calls * (ep - 1) * alpha + all_to_all_bytes(model, moe, layout, ep, layers) / bw


def _edp(layout, ep, etp):
    """The expert-data-parallel group: ranks holding the same experts, tp cp dp / (etp ep)
    (coupled, etp None: dp cp / ep)."""
    e = layout.tp if etp is None else etp
    return layout.tp * layout.cp * layout.dp // (e * ep)


def expert_state_bytes(model, moe, layout, ep, layers, etp=None):
    """{"weights", "grads", "optimizer"}: bytes of MLP model states one GPU of a stage of
    `layers` layers holds beyond what the dense equivalent already counts (negative where
    it holds less): its MoE layers' E/ep experts, cut over etp (None: tp), sharded by ZeRO
    over the expert-data-parallel ranks that hold the same experts (_edp), and its dense
    layers' MLPs, less the dense equivalent's MLPs, both cut over tp, sharded over dp x cp."""
    n_moe, t, dc = layers // moe.every, layout.tp, layout.dp * layout.cp
    experts = n_moe * moe.experts // ep * expert_params(model, moe) / (etp or t)
    dense = ((layers - n_moe) * _dense_mlp(model)
             - layers * _dense_mlp(_dense_equivalent(model, moe))) / t
    a = model_state_bytes(experts, _edp(layout, ep, etp), layout.zero, layout.precision)
    b = model_state_bytes(dense, dc, layout.zero, layout.precision)
    return {k: a[k] + b[k] for k in a}


def _dense_equivalent(model, moe):
    """The dense model whose MLPs do the experts' work: every layer of the mean MLP width,
    (n_moe top_k f_e c + (L - n_moe) f) / L, which gives the whole model's MLP FLOPs and
    activations (both linear in the width); exact per stage when every = 1."""
    n = moe_layers(model, moe)
    routed = moe.top_k * expert_ffn(model, moe) * (moe.capacity_factor or 1)
    width = (n * routed + (model.layers - n) * model.ffn) / model.layers
    return replace(model, ffn_hidden=int(round(width)))


def _zero_step_bytes(psi, n, zero, precision, reduces=1):
    """Bytes one of n ranks sends per step reducing (and, ZeRO 1-3, gathering) psi
    parameters: all-reduce 2 (n-1)/n psi g (ZeRO 0); reduce-scatter of the gradients
    (once per step at ZeRO 1, `reduces` times at 2 and 3) and all-gather of the weights
    (twice per micro-batch at 3), (n-1)/n each (Rajbhandari et al. 2020, section 7)."""
    if n == 1:
        return 0.0
    w, g, _ = ACCOUNTING[precision]
    f = (n - 1) / n * psi
    return {0: 2 * f * g, 1: f * (g + w), 2: f * (reduces * g + w),
            3: f * reduces * (g + 2 * w)}[zero]


def expert_dp_seconds(model, moe, cluster, layout, ep, layers, etp=None):
    """Seconds the experts' ZeRO / DP traffic adds (or, negative, saves) against the dense
    equivalent's MLPs on a stage of `layers` layers: _zero_step_bytes of the E/ep experts
    (cut over etp, None: tp) over their expert-data-parallel ranks (_edp) and the dense
    layers' MLPs over dp x cp, less the equivalent's MLPs over dp x cp, on the
    data-parallel link."""
    n_moe, t, dc = layers // moe.every, layout.tp, layout.dp * layout.cp
    m = model.global_batch // (layout.dp * layout.micro_batch)
    k = {2: m // (layout.accumulate or 1), 3: m}.get(layout.zero, 1)
    z, pr = layout.zero, layout.precision
    sent = (_zero_step_bytes(n_moe * moe.experts // ep * expert_params(model, moe) / (etp or t),
                             _edp(layout, ep, etp), z, pr, k)
            + _zero_step_bytes((layers - n_moe) * _dense_mlp(model) / t, dc, z, pr, k)
            - _zero_step_bytes(layers * _dense_mlp(_dense_equivalent(model, moe)) / t, dc, z, pr, k))
    return sent / cluster.link(t * dc)[1]


def _mlp_tp_seconds(model, cluster, layout, t):
    """One MoE layer's MLP-half of its TP messages per micro-batch, over t ranks
    (plan.traffic.tp_sent of one layer, its calls and bytes halved: the attention and the
    MLP each send half of a layer's), on the link of t consecutive ranks; 0 at t = 1."""
    if t == 1:
        return 0.0
    n = model.seq // layout.cp
    one = tp_sent(layout.micro_batch, n, model.hidden, 1, t, 0, ACCOUNTING[layout.precision][0], 1,
                  False, False, layout.sequence_parallel, True, 0, False,
                  int(layout.recompute == "full"))
    half = {k: (c // 2, b / 2) for k, (c, b) in one.items()}
    return collective_seconds(half, t, *cluster.link(t))


def expert_tp_seconds(model, moe, cluster, layout, layers, etp=None):
    """Seconds per step the expert TP changes against the dense equivalent's TP on a stage
    of `layers` layers (negative: saves; 0 when etp is None or the tp): per MoE layer and
    micro-batch, the MLP half over etp ranks, exposed whole, less what the dense estimate
    charged for both halves over tp beyond the attention half alone (with --tp-comm-overlap
    cost.py's max(c - g, u c) of a layer's messages c beside its GEMMs g, else c)."""
    t = layout.tp
    if etp is None or etp == t:
        return 0.0
    half = _mlp_tp_seconds(model, cluster, layout, t)
    if layout.tp_comm_overlap and t > 1:
        n = model.seq // layout.cp
        eq = _dense_equivalent(model, moe)
        gemms = G.layer_gemms(eq, layout.micro_batch * n, t)
        g = sum(G.training_seconds(M, N, K, cluster.gpu, cluster.gemm_shapes) for _, M, N, K in gemms)
        if layout.recompute == "full":                   # cost.py's window: + the rerun forward
            g += sum(G.gemm_seconds(M, N, K, cluster.gpu, cluster.gemm_shapes) for _, M, N, K in gemms)

        def shown(c):
            return max(c - g, TP_OVERLAP_SM_SHARE * c)
    else:
        def shown(c):
            return c
    per = shown(half) + _mlp_tp_seconds(model, cluster, layout, etp) - shown(2 * half)
    m = model.global_batch // (layout.dp * layout.micro_batch)
    return m * (layers // moe.every) * per


@dataclass
class MoEEstimate:
    dense: object              # plan.cost.Estimate of the dense equivalent
    ep: int
    all_to_all_s: float        # exposed, per step
    all_to_all_bytes: float    # sent per step by a GPU of the fullest stage
    expert_memory: dict        # model-state bytes beyond the dense equivalent's (may be < 0)
    expert_dp_s: float         # the experts' DP/ZeRO time beyond the equivalent's (may be < 0)
    etp: int                   # expert TP (None: coupled, = the layout's tp)
    expert_tp_s: float         # the expert TP's time against the equivalent's TP (may be < 0)
    step_time_s: float
    memory_bytes_per_gpu: float
    fits: bool
    total_params: float
    active_params: float
    tflops_per_gpu_model: float     # the active model FLOPs (and the router's) per GPU
    mfu: float

    @property
    def layout(self):
        return self.dense.layout

    def as_dict(self):
        return dict(self.dense.as_dict(), ep=self.ep, all_to_all_s=self.all_to_all_s,
                    all_to_all_bytes=self.all_to_all_bytes, expert_memory=dict(self.expert_memory),
                    expert_dp_s=self.expert_dp_s, etp=self.etp, expert_tp_s=self.expert_tp_s,
                    step_time_s=self.step_time_s, memory_bytes_per_gpu=self.memory_bytes_per_gpu,
                    fits=self.fits, total_params=self.total_params, active_params=self.active_params,
                    tflops_per_gpu_model=self.tflops_per_gpu_model, mfu=self.mfu)


def estimate_moe(model, moe, cluster, layout, ep=1, dense=None, etp=None):
    """The MoEEstimate of a layout with ep-way expert parallelism and etp-way expert TP
    (None: the layout's tp, coupled; module docstring); ValueError with the one-line
    reason when it is not legal. dense: the dense equivalent's plan.cost.Estimate, when
    the caller has it (a search over ep)."""
    why = legal_moe(model, moe, layout, ep, etp)
    if why:
        raise ValueError(why)
    if dense is None:
        dense = estimate(_dense_equivalent(model, moe), cluster, layout)
    layers = max(layout_stages(model, layout))           # the fullest stage's
    a2a_s = all_to_all_seconds(model, moe, cluster, layout, ep, layers, etp)
    extra = expert_state_bytes(model, moe, layout, ep, layers, etp)
    dp_s = max(-dense.dp_s, expert_dp_seconds(model, moe, cluster, layout, ep, layers, etp))
    etp_s = max(-dense.tp_s, expert_tp_seconds(model, moe, cluster, layout, layers, etp))
    step = dense.step_time_s + a2a_s + dp_s + etp_s
    mem = dense.memory_bytes_per_gpu + sum(extra.values())
    # model FLOPs: the active experts' (no capacity padding) and the router's, 3 x forward
    B, s, h = model.global_batch, model.seq, model.hidden
    shape = dict(heads=model.heads, kv_heads=model.kv, swiglu=model.swiglu)
    n = moe_layers(model, moe)
    flops = (step_flops(B, s, model.layers, h, model.vocab, ffn=model.ffn, **shape)[0]
             + 3 * n * (layer_flops(B, s, h, ffn=moe.top_k * expert_ffn(model, moe), **shape)
                        - layer_flops(B, s, h, ffn=model.ffn, **shape))
             + 6 * B * s * h * moe.experts * n)
    tflops = flops / step / cluster.gpus / 1e12
    return MoEEstimate(dense, ep, a2a_s, all_to_all_bytes(model, moe, layout, ep, layers), extra,
                       dp_s, etp, etp_s, step, mem, mem <= USABLE_MEMORY * cluster.gpu.memory_bytes,
                       params(model, moe), params(model, moe, True), tflops,
                       tflops * 1e12 / cluster.gpu.peak_flops)


def search_moe(model, moe, cluster, top=5, ep=None, **fixed):
    """The `top` best MoEEstimates (fitting first, then by step time; None: all): every
    layout plan.search tries for the dense equivalent (fixed: its keywords, held), each
    with every ep that divides the experts and dp x cp (or the ep given)."""
    out = []
    for lay in layouts(_dense_equivalent(model, moe), cluster, **fixed):
        eps = [ep] if ep else [k for k in range(1, moe.experts + 1)
                               if moe.experts % k == 0 and (lay.dp * lay.cp) % k == 0]
        eps = [k for k in eps if legal_moe(model, moe, lay, k) is None]
        if eps:
            dense = estimate(_dense_equivalent(model, moe), cluster, lay)
            out += [estimate_moe(model, moe, cluster, lay, k, dense) for k in eps]
    out.sort(key=lambda e: (not e.fits, e.step_time_s))
    return out if top is None else out[:top]


# ---------------------------------------------------------------------- the command line

MOE_HEADER = (" # {:>3}{:>3}{:>4}{:>5}{:>3}{:>3}{:>3} {:>2} {:<5}{:>8}{:>8}{:>6}{:>7}{:>6}{:>6}{:>7} fits"
              .format("tp", "ep", "pp", "dp", "mb", "v", "Z", "sp", "rc", "step s", "comp", "TP",
                      "bubble", "A2A", "MFU%", "mem GB"))


def moe_row(i, e):
    lay, d = e.layout, e.dense
    rc = {"selective": "sel"}.get(lay.recompute, lay.recompute)
    return (f"{i:>2} {lay.tp:>3}{e.ep:>3}{lay.pp:>4}{lay.dp:>5}{lay.micro_batch:>3}{lay.chunks:>3}"
            f"{lay.zero:>3} {'y' if lay.sequence_parallel else 'n':>2} {rc:<5}{e.step_time_s:>8.2f}"
            f"{d.compute_s:>8.2f}{d.tp_s:>6.2f}{d.bubble_s:>7.2f}{e.all_to_all_s:>6.2f}"
            f"{100 * e.mfu:>6.1f}{e.memory_bytes_per_gpu / 1e9:>7.1f} {'yes' if e.fits else 'NO'}")


def cli(args, model, cluster, fixed, parser):
    """python -m minidist.plan with --experts: the best layouts with expert parallelism
    (--ep held, else searched), or --only one; prints a table or --json; parser.error (one
    line, exit 2) on a bad combination."""
    import json
    moe = Experts(args.experts, args.top_k, args.expert_ffn, args.moe_every, args.capacity_factor)
    if args.only:
        if not (args.tp and args.pp):
            parser.error("--only needs --tp and --pp (one layout names both)")
        size = args.tp * args.pp * args.cp
        lay = Layout(args.tp, args.pp, args.gpus // size, args.micro_batch or 1, args.chunks or 1,
                     args.zero or 0, bool(args.sequence_parallel), args.recompute or "none",
                     flash_attention=args.flash_attention, cp=args.cp, cp_variant=args.cp_variant,
                     first_stage_layers=args.first_stage_layers,
                     last_stage_layers=args.last_stage_layers)
        why = legal(_dense_equivalent(model, moe), cluster, lay) or legal_moe(model, moe, lay,
                                                                              args.ep or 1)
        if why:
            parser.error(why)
        ests = [estimate_moe(model, moe, cluster, lay, args.ep or 1)]
    else:
        why = legal_moe(model, moe, Layout(1, 1, cluster.gpus, 1), args.ep or 1)
        if why:
            parser.error(why)
        keys = {k: v for k, v in fixed.items() if k not in ("cp", "tp_comm_overlap")}
        ests = search_moe(model, moe, cluster, None, args.ep, flash_attention=args.flash_attention,
                          cp=args.cp, cp_variant=args.cp_variant, **keys)
        if not ests:
            parser.error("no legal layout with these experts: ep must divide the experts and "
                         "dp x cp, tp the heads and the expert width")
    searched, ests = len(ests), ests[:args.top]
    if args.json:
        print(json.dumps({"model": {**model.__dict__, "params": params(model, moe),
                                    "active_params": params(model, moe, True)},
                          "experts": moe.__dict__, "gpu": args.gpu, "gpus": args.gpus,
                          "held": dict(fixed, **({"ep": args.ep} if args.ep else {})),
                          "searched": searched, "layouts": [e.as_dict() for e in ests]}))
        return 0
    print(f"{params(model, moe) / 1e9:.1f}B parameters, {params(model, moe, True) / 1e9:.1f}B active: "
          f"{moe.experts} experts, top {moe.top_k}, {model.layers} layers, h {model.hidden}; "
          f"{args.gpus} x {args.gpu}; {searched:,} layouts")
    print(MOE_HEADER)
    for i, e in enumerate(ests, 1):
        print(moe_row(i, e))
    print("seconds per step: comp(ute), exposed TP, bubble, A2A (the experts' all-to-alls, exposed);"
          "\nMFU: active model FLOPs; memory on the fullest GPU (plan.experts)")
    return 0
