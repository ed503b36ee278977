"""What the planner plans: a model's shape (Model), a layout of it on the GPUs (Layout),
and the rules a layout must keep to run at all (legal).

    python -c "from minidist.plan.layout import *; print(model_from_params(70e9))"

cost.py estimates a legal layout; search.py enumerates them. Rules (legal): tp x cp x pp
x dp is the GPU count; tp divides the heads and the key/value heads; the layers split over
the pp stages (stage_layers: evenly, or Llama 3's one fewer on each end stage, or the first
and last stage holding the layers the layout names, Megatron-LM's
--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers, the stages
between them an equal share of the rest); dp x micro-batch divides the global batch;
interleaving needs pp > 1, chunks dividing the fullest stage's layers, every stage within
one chunk of it, and micro-batches a multiple of pp; sequence parallelism needs tp > 1;
context parallelism (cp > 1) needs the
sequence cut into 2 cp equal chunks (Megatron's load-balanced layout: rank r holds chunks
r and 2cp-1-r), and Ulysses the heads and key/value heads of a TP rank divisible by cp.

Rank order, Megatron-LM's default (tp, cp, dp, pp, tp fastest): a CP group is cp ranks
tp apart, spanning tp x cp consecutive ranks, so it lies inside a node when tp x cp is at
most the node's GPUs (8) and crosses nodes otherwise (Llama 3's TP 8 x CP 16: 128 ranks,
16 nodes); the weight gradients are reduced over dp x cp ranks spanning tp x cp x dp.
(Megatron's full default is tp-cp-ep-dp-pp; no experts here.) This engine's ProcessGrid
orders tp, cp, pp, dp (pp before dp, kept from the earlier lessons): that moves which link
a group lands on, not what one GPU sends, which plan.step_bytes counts by the GPU's rank
within each group, so the planner's bytes are the engine's under either order.
"""
from dataclasses import dataclass

from minidist.plan.context import VARIANTS as CP_VARIANTS
from minidist.plan.flops import RECOMPUTE
from minidist.plan.memory import ACCOUNTING


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer. global_batch in sequences. Defaults are GPT's: a 4h GELU
    MLP with biases, as many key/value heads as heads, learned positions, a tied head;
    swiglu=True is Llama's: three MLP matrices, no biases, RMSNorm, RoPE, an untied head.
    dropout: None follows the shape (GPT's with dropout, as Korthikanti et al. count it;
    Llama's without, as Llama 3 trains), or True / False (has_dropout)."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    global_batch: int
    ffn_hidden: int = None
    kv_heads: int = None
    swiglu: bool = False
    dropout: bool = None

    @property
    def has_dropout(self):
        """Whether the layers drop out (and so keep masks for backward): dropout, or when
        None, not swiglu (this project's default: GPT's shape with, Llama's without)."""
        return (not self.swiglu) if self.dropout is None else bool(self.dropout)

    @property
    def ffn(self):
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def kv(self):
        return self.heads if self.kv_heads is None else self.kv_heads

    def layer_params(self):
        """Parameters of one layer: Q, K, V, output and the MLP's matrices, plus (GPT) their
        biases and two layer norms, 13h for GPT's shapes, or (Llama) two RMSNorm weights."""
        h, f = self.hidden, self.ffn
        h_kv = self.kv * (h // self.heads)
        matrices = h * (2 * h + 2 * h_kv) + (3 if self.swiglu else 2) * h * f
        small = 2 * h if self.swiglu else (h + 2 * h_kv) + h + f + h + 4 * h
        return matrices + small

    def params(self):
        """All parameters. GPT: L(12h^2 + 13h) + Vh + sh + 2h, Narayanan et al.'s
        12lh^2(1 + 13/12h + (V+s)/12lh) plus the final layer norm; Llama: an untied head Vh
        in place of the position table."""
        h, V = self.hidden, self.vocab
        ends = 2 * V * h + h if self.swiglu else V * h + self.seq * h + 2 * h
        return self.layers * self.layer_params() + ends


def model_from_params(psi, seq=4096, global_batch=1024, vocab=51200):
    """A GPT shape of about psi parameters, this project's shape family: heads of 128, the
    hidden size h the multiple of 1024 nearest (100 psi / 12)^(1/3) (GPT-3's 175B has
    h/L = 128, Llama 2's 70B about 100), then the layers, a multiple of 8, that bring
    12 L h^2 nearest psi. model_from_params(70e9) is h 8192, 64 heads, 88 layers (71.5B)."""
    h = max(1024, 1024 * round((100 * psi / 12) ** (1 / 3) / 1024))
    per_layer = Model(1, h, h // 128, vocab, seq, global_batch).layer_params()
    rest = vocab * h + seq * h
    layers = max(8, 8 * round((psi - rest) / per_layer / 8))
    return Model(layers, h, h // 128, vocab, seq, global_batch)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    chunks: int = 1                   # interleaved 1F1B with v chunks per rank; 1: plain 1F1B
    zero: int = 0                     # ZeRO stage over the dp group (1: Megatron's distributed optimizer)
    sequence_parallel: bool = False
    recompute: str = "none"           # none, selective, full
    precision: str = "megatron"       # a name of plan.memory.ACCOUNTING
    flash_attention: bool = False     # no s x s scores in memory (Dao et al. 2022)
    bucket_bytes: int = None          # DP/ZeRO-2 gradient buckets: None one flat buffer, 0 one per
                                      # parameter, n buckets of >= n bytes (plan.step_bytes)
    cp: int = 1                       # context parallelism: each sequence cut over cp ranks
    cp_variant: str = "allgather"     # ring, ulysses or allgather (Llama 3's)
    first_stage_layers: int = None    # layers on the first / last pipeline stage (None: the
    last_stage_layers: int = None     # default split, stage_layers); the others share the rest
    accumulate: int = None            # ZeRO 2: micro-batches whose gradients a rank accumulates
                                      # locally (fp32) before each reduce-scatter; None or 1: every
                                      # micro-batch (this engine). Llama 3's FSDP: the N contiguous
                                      # micro-batches of its schedule (plan.memory.LLAMA3_FSDP_ZERO)
    tp_comm_overlap: bool = False     # TP's all-gathers / reduce-scatters hidden behind the layer's
                                      # GEMMs (Megatron-LM --tp-comm-overlap; needs SP; cost.py)

    @property
    def gpus(self):
        return self.tp * self.cp * self.pp * self.dp


def stage_layers(L, p, first=None, last=None):
    """Layers per pipeline stage, first to last, or None when they do not split so.

    first, last None: L/p each; or, Llama 3's layout (Grattafiori et al. 2024, section
    3.3.2), one fewer on the first and last stage when p divides L + 2. Given (Megatron-LM's
    --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers), the first
    and/or last stage holds that many layers (at least 1) and the stages left share the
    rest equally, at least one each: stage_layers(126, 16, 6, 8) = [6] + [8] * 15. With
    p = 1 the one stage holds all L."""
    if first is None and last is None:
        if L % p == 0:
            return [L // p] * p
        if p > 2 and (L + 2) % p == 0:
            k = (L + 2) // p
            return [k - 1] + [k] * (p - 2) + [k - 1]
        return None
    if p == 1:
        return [L] if {first, last} <= {None, L} else None
    given = [x for x in (first, last) if x is not None]
    if min(given) < 1:
        return None
    rest, others = L - sum(given), p - len(given)
    if others == 0:
        return [first, last] if rest == 0 else None
    if rest < others or rest % others:
        return None
    k = rest // others
    return ([k] if first is None else [first]) + [k] * (p - 2) + ([k] if last is None else [last])


def layout_stages(model, layout):
    """Layers of each pipeline stage of a layout (stage_layers), or None."""
    return stage_layers(model.layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)


def legal(model, cluster, layout):
    """None when the layout can run this model on this cluster, else a one-line reason."""
    t, p, d, b, v = layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.chunks
    c = layout.cp
    if min(t, p, d, b, v, c) < 1:
        return "tp, cp, pp, dp, micro-batch and chunks must be at least 1"
    if layout.gpus != cluster.gpus:
        if c == 1:
            return f"tp x pp x dp = {t} x {p} x {d} = {t * p * d}, not the {cluster.gpus} GPUs"
        return (f"tp x pp x dp x cp = {t} x {p} x {d} x {c} = {layout.gpus}, "
                f"not the {cluster.gpus} GPUs")
    if model.heads % t or model.kv % t:
        return f"tp {t} does not divide the {model.heads} heads ({model.kv} key/value heads)"
    if layout.cp_variant not in CP_VARIANTS:
        return f"the CP variant must be one of {', '.join(CP_VARIANTS)}, not {layout.cp_variant!r}"
    if c > 1 and model.seq % (2 * c):
        return (f"cp {c} needs the sequence {model.seq} cut into 2 x cp = {2 * c} equal chunks "
                "(the load-balanced layout)")
    if c > 1 and layout.cp_variant == "ulysses" and (model.heads // t % c or model.kv // t % c):
        return (f"Ulysses cp {c} does not divide the {model.heads // t} heads "
                f"({model.kv // t} key/value heads) of a TP rank")
    layers = layout_stages(model, layout)
    if layers is None:
        if layout.first_stage_layers is None and layout.last_stage_layers is None:
            return (f"pp {p} does not divide the {model.layers} layers (nor {model.layers + 2}, Llama 3's "
                    "layout with one layer fewer on each end stage)")
        ends = ", ".join(f"{name} stage {n}" for name, n in (("first", layout.first_stage_layers),
                                                               ("last", layout.last_stage_layers))
                         if n is not None)
        return (f"the {model.layers} layers do not split over pp {p} with {ends} "
                "(the other stages share the rest equally, at least 1 each)")
    if model.global_batch % (d * b):
        return f"dp x micro-batch = {d} x {b} does not divide the global batch {model.global_batch}"
    m = model.global_batch // (d * b)
    top = max(layers)
    if v > 1 and (p == 1 or top % v or min(layers) < top - top // v or m % p):
        return (f"{v} chunks need pp > 1, chunks dividing the fullest stage's layers, every stage "
                "within one chunk of it, micro-batches a multiple of pp")
    if layout.zero not in (0, 1, 2, 3):
        return f"ZeRO stage must be 0-3, not {layout.zero}"
    if layout.recompute not in RECOMPUTE:
        return f"recompute must be one of {', '.join(RECOMPUTE)}"
    if layout.precision not in ACCOUNTING:
        return f"precision must be one of {', '.join(ACCOUNTING)}"
    if layout.sequence_parallel and t == 1:
        return "sequence parallelism needs tp > 1"
    if layout.tp_comm_overlap and not layout.sequence_parallel:
        return "--tp-comm-overlap needs sequence parallelism"
    k = layout.accumulate
    if k is not None and (layout.zero != 2 or k < 1 or m % k):
        return (f"accumulating {k} micro-batches before a reduce-scatter needs ZeRO 2 and a divisor "
                f"of the {m} micro-batches")
    if layout.bucket_bytes is not None and layout.bucket_bytes < 0:
        return f"bucket bytes must be None (one buffer), 0 (per parameter) or more, not {layout.bucket_bytes}"
    return None
