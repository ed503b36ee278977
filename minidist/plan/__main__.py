"""The planner: the best layouts of a model on a cluster, or the arithmetic of one layout.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm
    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm --json
    python -m minidist.plan --params 405e9 --gpus 16384 --gpu h100-sxm --layers 126 \
        --hidden 16384 --heads 128 --kv-heads 8 --ffn-hidden 53248 --swiglu --seq 8192 \
        --global-batch-tokens 16M --pp 16
        (Llama 3 405B's shape: pp 16 held, its 126 layers split 7, 8, ..., 8, 7 or so;
        tp, ZeRO, SP, recomputation, chunks and the micro-batch searched)
    python -m minidist.plan --gpus 8192 --gpu h100-sxm --tp 8 --pp 16 --layers 126 \
        --hidden 16384 --heads 128 --kv-heads 8 --ffn-hidden 53248 --vocab 128256 \
        --swiglu --seq 8192 --global-batch 2048 --only --explain
    python -m minidist.plan --gpus 8192 --gpu h100-sxm --tp 8 --pp 16 --chunks 8 --zero 2 \
        --accumulate 16 \
        --sequence-parallel --flash-attention --layers 126 --hidden 16384 --heads 128 \
        --kv-heads 8 --ffn-hidden 53248 --vocab 128256 --swiglu --seq 8192 --global-batch 2048 \
        --only
        (Llama 3 405B's layout as plan.published models it: Grattafiori et al. 2024, Table 4)
    python -m minidist.plan --gpus 16384 --gpu h100-sxm --tp 8 --pp 16 --cp 16 --chunks 8 \
        --zero 2 --accumulate 16 --sequence-parallel --flash-attention --layers 126 --hidden 16384 \
        --heads 128 --kv-heads 8 --ffn-hidden 53248 --vocab 128256 --swiglu --seq 131072 \
        --global-batch 128 --only
        (its 128K stage: context parallelism 16, all-gather of K and V, DP 8)

Every layout flag the user gives is held and every other one searched (minidist.plan.search:
tp, pp and the layers on the end stages, ZeRO stage, sequence parallelism, recomputation,
interleaved chunks, micro-batch); the best --top are printed. --only prints exactly one
layout: --tp and --pp as given and every field not given at its plain default (micro-batch
1, one chunk, ZeRO 0, no sequence parallelism, no recomputation, the layers split evenly or
Llama 3's way). --cp N (context parallelism: each sequence cut over N GPUs; --cp-variant
ring, ulysses or allgather, Llama 3's, the default) is held wherever it is given; without it
the search keeps cp = 1 (CP pays only at long sequences: ask for it). A warning says when the
batch leaves every layout bubble-bound: each layout that fits idles more than BUBBLE_BOUND
(a quarter) of its compute + bubble in the pipeline bubble, (p-1)/(v m + p-1) of
plan.pipeline, m the micro-batches per step. Figures come from
minidist.plan.cost (docs/reference.md#the-planner). This module imports no MPI (the
planner is arithmetic; tests/test_plan_cli.py runs it where mpi4py cannot be imported).
"""
import argparse
import json
import sys
import textwrap

from minidist.plan.cluster import GPUS, make_cluster
from minidist.plan.cost import describe, estimate
from minidist.plan.rules import parameter_count
from minidist.plan.layout import (CP_VARIANTS, RECOMPUTE, Layout, Model, layout_stages, legal,
                                  model_from_params)
from minidist.plan.search import search, stage_splits

GB = 1e9
MIN_PARAMS = 1e6        # below a million parameters the planner's shapes and links mean nothing
BUBBLE_BOUND = 0.25     # bubble-bound: the bubble over this share of compute + bubble (this project's line)
TOKENS = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}   # batch tokens, as papers count them


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, exit 2 (the usage is under --help)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _whole(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return v


def _params(text):
    """parameter_count (70e9, 70B, 350M), refused below MIN_PARAMS."""
    v = parameter_count(text)
    if v < MIN_PARAMS:
        raise argparse.ArgumentTypeError(f"{text!r} is {v:g} parameters: the planner needs at least "
                                         "a million (1e6, 1M)")
    return v


def _tokens(text):
    """A token count: whole (16777216, 16e6) or with a binary suffix K, M, G, T (16M = 2^24 =
    16,777,216: Llama 3's 16M tokens are 2048 sequences of 8192)."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = TOKENS.get(t[-1:].lower(), 1) if t[-1:].isalpha() else 1
    try:
        v = float(t[:-1] if t[-1:].isalpha() else t) * scale
    except ValueError:
        v = float("nan")
    if not 1 <= v < float("inf") or v != int(v):
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens such as 16M (2^24), "
                                         f"4194304 or 4e6, got {text!r}")
    return int(v)


def build_parser():
    p = _Parser(prog="python -m minidist.plan", description=__doc__.split("\n\n")[0],
                epilog=("Every layout flag given is held, every other searched; --only: exactly "
                        "one layout. Bubble-bound: in every layout that fits, the pipeline "
                        f"bubble over {BUBBLE_BOUND:.0%} of compute + bubble, (p-1)/(v m + p-1)."))
    p.add_argument("--params", type=_params,
                   help="parameter count, at least 1M: 70e9, 70B (a GPT shape)")
    p.add_argument("--gpus", type=_whole, required=True, help="GPUs in the cluster")
    p.add_argument("--gpu", choices=list(GPUS), default="h100-sxm", help="GPU type")
    p.add_argument("--gpus-per-node", type=_whole, default=8, help="GPUs per node (8)")
    for name, helptext in (("tp", "tensor-parallel size (held; else searched)"),
                           ("pp", "pipeline stages (held; else searched)"),
                           ("micro-batch", "sequences per micro-batch (held; else 1, 2, 4, 8)"),
                           ("chunks", "interleaved chunks per rank, 1: plain 1F1B (held; else 1, 2, 4, 8)"),
                           ("first-stage-layers", "layers on the first pipeline stage (Megatron's "
                                                  "--decoder-first-pipeline-num-layers; held)"),
                           ("last-stage-layers", "layers on the last pipeline stage (held; the "
                                                 "stages between share the rest equally)")):
        p.add_argument(f"--{name}", type=_whole, help=helptext)
    p.add_argument("--cp", type=_whole, default=1,
                   help="context-parallel size: each sequence cut over cp GPUs (1; never searched)")
    p.add_argument("--cp-variant", choices=CP_VARIANTS, default="allgather",
                   help="the attention's exchange under CP (allgather, Llama 3's)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism on (or --no-...: off); else both searched")
    p.add_argument("--recompute", choices=RECOMPUTE, help="recomputation (held; else all three searched)")
    p.add_argument("--tp-comm-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="TP's messages hidden behind the layer's GEMMs, Megatron-LM's flag (needs "
                        "SP; or --no-...: off); else both searched where SP is on")
    p.add_argument("--gemm-shapes", action="store_true",
                   help="time each GEMM at its shape's efficiency (tiles, waves; plan.gemm)")
    p.add_argument("--link-efficiency", action="store_true",
                   help="links at Calculon's achieved fractions (NVLink 0.6, network 0.9)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the DP group (held; else 0-3 searched)")
    for name, helptext in (("layers", "layers L"), ("hidden", "hidden size h"), ("heads", "heads a"),
                           ("seq", "sequence length (4096)"), ("vocab", "vocabulary (51200)"),
                           ("global-batch", "global batch in sequences (1024)"),
                           ("ffn-hidden", "MLP width (4h)"), ("kv-heads", "key/value heads (= heads)")):
        p.add_argument(f"--{name}", type=_whole, help=helptext)
    p.add_argument("--global-batch-tokens", type=_tokens,
                   help="global batch in tokens, a whole number of --seq: 16M (K, M, G binary: "
                        "16M = 2^24), 4194304")
    p.add_argument("--swiglu", action="store_true", help="Llama's three-matrix MLP")
    p.add_argument("--flash-attention", action="store_true",
                   help="no s x s attention scores kept or written (Dao et al. 2022)")
    p.add_argument("--accumulate", type=_whole,
                   help="with --only and ZeRO 2: micro-batches whose gradients are accumulated in "
                        "fp32 before each reduce-scatter (Llama 3's FSDP: 16; else 1)")
    p.add_argument("--experts", type=_whole, help="experts per MoE layer (mixture of experts; "
                   "plan.experts)")
    p.add_argument("--top-k", type=_whole, default=2, help="experts each token is routed to (2)")
    p.add_argument("--ep", type=_whole, help="expert-parallel size, inside the DP group (held; "
                   "else every divisor of the experts and dp x cp)")
    p.add_argument("--expert-ffn", type=_whole, help="an expert's MLP width (the MLP's)")
    p.add_argument("--moe-every", type=_whole, default=1, help="one MoE layer every N layers (1)")
    p.add_argument("--capacity-factor", type=float,
                   help="each expert takes at most this x its even share of tokens (padded); "
                        "else dropless")
    p.add_argument("--only", action="store_true",
                   help="exactly one layout: needs --tp and --pp; what is not given takes its "
                        "plain default (micro-batch 1, 1 chunk, ZeRO 0, no SP, no recomputation)")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...], "warnings": [...]}')
    p.add_argument("--explain", action="store_true", help="the arithmetic of the first layout")
    p.add_argument("--top", type=_whole, default=5, help="layouts to print (5)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: step time against memory per GPU "
                   "of every layout estimated, the fastest that fit (Pareto front) drawn as a line")
    return p


def make_model(args, p):
    shape = (args.layers, args.hidden, args.heads)
    seq, vocab = args.seq or 4096, args.vocab or 51200
    batch = args.global_batch or 1024
    if args.global_batch_tokens is not None:
        if args.global_batch is not None:
            p.error("give the global batch once: --global-batch (sequences) or --global-batch-tokens")
        batch, left = divmod(args.global_batch_tokens, seq)
        if left or not batch:
            p.error(f"--global-batch-tokens {args.global_batch_tokens:,} is not a whole number of "
                    f"sequences of {seq} tokens")
    if all(x is not None for x in shape):
        if args.hidden % args.heads:
            p.error(f"--heads {args.heads} does not divide --hidden {args.hidden}")
        kv = args.kv_heads
        if kv is not None and args.heads % kv:
            p.error(f"--kv-heads {kv} does not divide --heads {args.heads}")
        return Model(args.layers, args.hidden, args.heads, vocab, seq, batch, args.ffn_hidden, kv, args.swiglu)
    if any(x is not None for x in shape):
        p.error("a shape needs all of --layers, --hidden and --heads")
    if args.params is None:
        p.error("give --params or a shape (--layers --hidden --heads)")
    return model_from_params(args.params, seq, batch, vocab)


def row(i, e, cp=False):
    """One layout's line; cp: with the cp and exposed-CP columns (recompute shortened)."""
    lay = e.layout
    rc = {"selective": "sel"}.get(lay.recompute, lay.recompute) if cp else lay.recompute
    return (f"{i:>2} {lay.tp:>3}" + (f"{lay.cp:>3}" if cp else "")
            + f"{lay.pp:>4}{lay.dp:>5}{lay.micro_batch:>3}{lay.chunks:>3}{lay.zero:>3}"
            f" {('yo' if lay.tp_comm_overlap else 'y') if lay.sequence_parallel else 'n':>2}"
            f" {rc:<{5 if cp else 9}}{e.step_time_s:>8.2f}"
            f"{e.compute_s:>8.2f}{e.tp_s:>6.2f}" + (f"{e.cp_s:>6.2f}" if cp else "")
            + f"{e.bubble_s:>7.2f}{e.pp_s:>5.2f}{e.dp_s:>6.2f}"
            f"{100 * e.mfu:>6.1f}{_gb(e.memory_bytes_per_gpu):>7} {'yes' if e.fits else 'NO'}")


def _gb(nbytes):
    """GB in at most 6 characters: one decimal below 10,000 GB, none above."""
    return f"{nbytes / GB:.1f}" if nbytes < 1e4 * GB else f"{nbytes / GB:.0f}"


HEADER = (" # {:>3}{:>4}{:>5}{:>3}{:>3}{:>3} {:>2} {:<9}{:>8}{:>8}{:>6}{:>7}{:>5}{:>6}{:>6}{:>7} fits"
          .format("tp", "pp", "dp", "mb", "v", "Z", "sp", "recompute", "step s", "comp", "TP", "bubble",
                  "PP", "DP", "MFU%", "mem GB"))
HEADER_CP = ((" # {:>3}{:>3}{:>4}{:>5}{:>3}{:>3}{:>3} {:>2} {:<5}{:>8}{:>8}{:>6}{:>6}{:>7}{:>5}{:>6}"
              "{:>6}{:>7} fits").format("tp", "cp", "pp", "dp", "mb", "v", "Z", "sp", "rc", "step s", "comp", "TP", "CP",
                     "bubble", "PP", "DP", "MFU%", "mem GB"))


def held(args):
    """The layout fields the user gave: {name: value}, what the search holds."""
    names = ("tp", "pp", "micro_batch", "chunks", "zero", "sequence_parallel", "recompute",
             "first_stage_layers", "last_stage_layers", "tp_comm_overlap")
    out = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    return out | ({"cp": args.cp} if args.cp > 1 else {})


def bubble_share(e):
    """The bubble's share of the pipeline's time, bubble / (compute + bubble): the bubble
    fraction (p-1)/(v m + p-1) of plan.pipeline as the estimate times it (independent of the
    step's other terms, so a layout slow for other reasons does not hide a bubble)."""
    return e.bubble_s / (e.compute_s + e.bubble_s) if e.bubble_s else 0.0


def bubble_bound(ests):
    """A warning line when every layout that fits (or, none fitting, every one) idles more
    than BUBBLE_BOUND of its compute + bubble in the pipeline bubble; else None."""
    pool = [e for e in ests if e.fits] or ests
    least = min(pool, key=bubble_share)
    frac = bubble_share(least)
    if frac <= BUBBLE_BOUND:
        return None
    lay = least.layout
    return (f"warning: bubble-bound: each of the {len(pool)} layouts that fit idles over "
            f"{BUBBLE_BOUND:.0%} of its compute + bubble in the pipeline bubble (least {frac:.0%}: "
            f"tp {lay.tp} pp {lay.pp} dp {lay.dp}, v {lay.chunks}, micro-batch {lay.micro_batch}); "
            f"the global batch of {least.model.global_batch} sequences gives too few micro-batches "
            "for this many GPUs: a larger batch or fewer GPUs")


def stages_note(i, e):
    """'#i layers per stage: 7, 8 x 14, 7' for a layout whose stages differ, else None."""
    layers = layout_stages(e.model, e.layout)
    if len(set(layers)) == 1:
        return None
    mid = layers[1:-1]
    body = f"{mid[0]} x {len(mid)}, " if mid else ""
    return f"  #{i} layers per stage: {layers[0]}, {body}{layers[-1]}"


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    model = make_model(args, p)
    try:
        cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node,
                               link_efficiency=args.link_efficiency, gemm_shapes=args.gemm_shapes)
    except ValueError as err:
        p.error(str(err))
    cp = args.cp
    if cp > 1 and model.seq % (2 * cp):
        p.error(f"--cp {cp} needs --seq {model.seq} cut into 2 x cp = {2 * cp} equal chunks "
                "(the load-balanced layout): give a --seq that 2 x cp divides")
    if args.gpus % cp:
        p.error(f"--cp {cp} does not divide the {args.gpus} GPUs")
    if args.tp and (model.heads % args.tp or model.kv % args.tp):
        p.error(f"--tp {args.tp} does not divide the {model.heads} heads ({model.kv} key/value heads)")
    if cp > 1 and args.cp_variant == "ulysses" and args.tp and (model.heads // args.tp % cp
                                                                or model.kv // args.tp % cp):
        p.error(f"Ulysses cp {cp} does not divide the {model.heads // args.tp} heads "
                f"({model.kv // args.tp} key/value heads) of a TP rank")
    size = (args.tp or 1) * (args.pp or 1) * cp
    if args.gpus % size:
        what = "x".join(n for n, v in (("tp", args.tp), ("pp", args.pp), ("cp", cp > 1)) if v)
        p.error(f"{what.replace('x', ' x ')} = {size} does not divide the {args.gpus} GPUs")
    fixed = held(args)
    if args.experts:                        # mixture of experts: plan.experts' layering
        from minidist.plan.experts import cli
        return cli(args, model, cluster, fixed, p)
    if args.ep:
        p.error("--ep needs --experts")
    if args.accumulate and not args.only:
        p.error("--accumulate is held only in one layout: give --only (with --zero 2)")
    if args.tp_comm_overlap and args.sequence_parallel is False:
        p.error("--tp-comm-overlap needs SP: drop --no-sequence-parallel")   # Megatron-LM's rule
    if args.only:
        if not (args.tp and args.pp):
            p.error("--only needs --tp and --pp (one layout names both)")
        lay = Layout(args.tp, args.pp, args.gpus // size, args.micro_batch or 1, args.chunks or 1,
                     args.zero or 0, bool(args.sequence_parallel), args.recompute or "none",
                     flash_attention=args.flash_attention, cp=cp, cp_variant=args.cp_variant,
                     first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers,
                     tp_comm_overlap=bool(args.tp_comm_overlap), accumulate=args.accumulate)
        why = legal(model, cluster, lay)
        if why:
            p.error(why)
        ests = [estimate(model, cluster, lay)]
    else:
        if args.pp and not stage_splits(model.layers, args.pp, args.first_stage_layers,
                                        args.last_stage_layers):
            ends = [f"{n} stage {v}" for n, v in (("first", args.first_stage_layers),
                                                  ("last", args.last_stage_layers)) if v]
            p.error(f"--pp {args.pp} does not divide the {model.layers} layers"
                    + (f" with {' and '.join(ends)}" if ends else " (nor with lighter end stages)"))
        keys = {k: v for k, v in fixed.items() if k != "cp"}
        ests = search(model, cluster, top=None, flash_attention=args.flash_attention, cp=cp,
                      cp_variant=args.cp_variant, **keys)
        if not ests:
            p.error("no legal layout: dp x micro-batch must divide the global batch, tp the heads, "
                    "the layers split over pp" + (", and (Ulysses) cp a TP rank's heads" if cp > 1 else "")
                    + (" (with the flags held)" if keys else ""))
        if not ests[0].fits:
            p.error(f"the model fits no layout{' with the flags held' if keys else ''}: the least memory "
                    f"needed is {min(e.memory_bytes_per_gpu for e in ests) / GB:.1f} GB per GPU, "
                    f"{args.gpu} has {cluster.gpu.memory_bytes / GB:.0f} GB")
    warnings = [w for w in (bubble_bound(ests),) if w]
    searched = len(ests)
    if args.plot:
        from minidist.plan import plot      # stdlib only; loaded when a picture is asked for
        try:
            plot.write(args.plot, ests, cluster.gpu.memory_bytes,
                       f"{model.params() / 1e9:.1f}B parameters on {args.gpus:,} x {args.gpu}: "
                       f"{searched:,} layout{'s' * (searched > 1)}")
        except OSError as err:
            p.error(f"--plot {args.plot}: cannot write it ({err.strerror or err})")
    ests = ests[:args.top]
    if args.json:
        print(json.dumps({"model": {**model.__dict__, "params": model.params()},
                          "gpu": args.gpu, "gpus": args.gpus, "held": fixed, "only": args.only,
                          "searched": searched, "warnings": warnings,
                          "layouts": [dict(e.as_dict(), stage_layers=layout_stages(model, e.layout))
                                      for e in ests]}))
        for w in warnings:
            print(w, file=sys.stderr)
        return 0
    print(f"{model.params() / 1e9:.1f}B parameters: {model.layers} layers, h {model.hidden}, "
          f"{model.heads} heads, s {model.seq}, batch {model.global_batch}; {args.gpus} x {args.gpu}")
    hold = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in fixed.items())
    print(textwrap.fill(f"global batch {model.global_batch * model.seq:,} tokens; "
                        + (f"one layout (--only): {hold}" if args.only else
                           f"{searched:,} legal layouts searched" + (f", holding {hold}" if hold else "")),
                        100, subsequent_indent="  "))
    print(HEADER_CP if cp > 1 else HEADER)
    for i, e in enumerate(ests, 1):
        print(row(i, e, cp > 1))
    notes = [n for n in (stages_note(i, e) for i, e in enumerate(ests, 1)) if n]
    if notes:
        print(*notes, sep="\n")
    if cp > 1:
        print(f"seconds per step: comp(ute) incl. elementwise, exposed TP, exposed CP ({args.cp_variant}),"
              "\nbubble, PP, DP; memory on the fullest GPU; rc: recompute; sp yo: with --tp-comm-overlap")
    else:
        print("seconds per step: comp(ute) incl. elementwise, exposed TP, bubble, PP, DP; memory on "
              "the fullest GPU\nsp yo: sequence parallel with --tp-comm-overlap")
    for w in warnings:
        print(textwrap.fill(w, 100, subsequent_indent="  "))
    if args.explain:
        e = ests[0]
        print("the arithmetic of layout 1 (docs/reference.md#the-planner):")
        print(*describe(e), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
