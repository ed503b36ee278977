"""The planner: the best layouts of a model on a cluster, or the arithmetic of one layout.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm
    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm --json
    python -m minidist.plan --gpus 8192 --gpu h100-sxm --tp 8 --pp 16 --layers 126 \\
        --hidden 16384 --heads 128 --kv-heads 8 --ffn-hidden 53248 --vocab 128256 \\
        --swiglu --seq 8192 --global-batch 2048 --explain
    python -m minidist.plan --gpus 8192 --gpu h100-sxm --tp 8 --pp 16 --chunks 8 --zero 1 \
        --sequence-parallel --flash-attention --layers 126 --hidden 16384 --heads 128 \
        --kv-heads 8 --ffn-hidden 53248 --vocab 128256 --swiglu --seq 8192 --global-batch 2048
        (Llama 3 405B's layout as plan.published models it: Grattafiori et al. 2024, Table 4)
    python -m minidist.plan --gpus 16384 --gpu h100-sxm --tp 8 --pp 16 --cp 16 --chunks 8 \
        --zero 1 --sequence-parallel --flash-attention --layers 126 --hidden 16384 \
        --heads 128 --kv-heads 8 --ffn-hidden 53248 --vocab 128256 --swiglu --seq 131072 \
        --global-batch 128
        (its 128K stage: context parallelism 16, all-gather of K and V, DP 8)

With --tp and --pp both given the layout is fixed (the other fields default to micro-batch
1, one chunk, no sequence parallelism, no recomputation, ZeRO 0 unless given) and that one
layout is printed; otherwise every legal layout is estimated (minidist.plan.search) and
the best --top are printed. Figures come from minidist.plan.cost (docs/reference.md#the-planner).
--cp N (context parallelism: each sequence cut over N GPUs; --cp-variant ring, ulysses or
allgather, Llama 3's, the default) is held wherever it is given, in one layout or the
search; without it the search keeps cp = 1 (CP pays only at long sequences: ask for it).
"""
import argparse
import json
import sys

from minidist.memory import parameter_count
from minidist.plan.cluster import GPUS, make_cluster
from minidist.plan.cost import describe, estimate
from minidist.plan.layout import (CP_VARIANTS, RECOMPUTE, Layout, Model, legal, model_from_params,
                                  stage_layers)
from minidist.plan.search import search

GB = 1e9


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


def build_parser():
    p = _Parser(prog="python -m minidist.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parameter_count, help="parameter count: 70e9, 70B (a GPT shape)")
    p.add_argument("--gpus", type=_whole, required=True, help="GPUs in the cluster")
    p.add_argument("--gpu", choices=list(GPUS), default="h100-sxm", help="GPU type")
    p.add_argument("--gpus-per-node", type=_whole, default=8, help="GPUs per node (8)")
    for name, helptext in (("tp", "tensor-parallel size"), ("pp", "pipeline stages"),
                           ("micro-batch", "sequences per micro-batch"),
                           ("chunks", "interleaved chunks per rank (1: plain 1F1B)")):
        p.add_argument(f"--{name}", type=_whole, help=helptext)
    p.add_argument("--cp", type=_whole, default=1,
                   help="context-parallel size: each sequence cut over cp GPUs (1)")
    p.add_argument("--cp-variant", choices=CP_VARIANTS, default="allgather",
                   help="the attention's exchange under CP (allgather, Llama 3's)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", choices=RECOMPUTE)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage over the DP group")
    for name, helptext in (("layers", "layers L"), ("hidden", "hidden size h"), ("heads", "heads a"),
                           ("seq", "sequence length (4096)"), ("vocab", "vocabulary (51200)"),
                           ("global-batch", "global batch in sequences (1024)"),
                           ("ffn-hidden", "MLP width (4h)"), ("kv-heads", "key/value heads (= heads)")):
        p.add_argument(f"--{name}", type=_whole, help=helptext)
    p.add_argument("--swiglu", action="store_true", help="Llama's three-matrix MLP")
    p.add_argument("--flash-attention", action="store_true",
                   help="no s x s attention scores kept or written (Dao et al. 2022)")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]}')
    p.add_argument("--explain", action="store_true", help="the arithmetic of the first layout")
    p.add_argument("--top", type=_whole, default=5, help="layouts to print (5)")
    return p


def make_model(args, p):
    shape = (args.layers, args.hidden, args.heads)
    seq, batch, vocab = args.seq or 4096, args.global_batch or 1024, args.vocab or 51200
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
            f" {'y' if lay.sequence_parallel else 'n':>2} {rc:<{5 if cp else 9}}{e.step_time_s:>8.2f}"
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


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    model = make_model(args, p)
    try:
        cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node)
    except ValueError as err:
        p.error(str(err))
    fixed = dict(micro_batch=args.micro_batch, chunks=args.chunks, zero=args.zero,
                 recompute=args.recompute, sequence_parallel=True if args.sequence_parallel else None,
                 flash_attention=args.flash_attention, cp=args.cp, cp_variant=args.cp_variant)
    cp = args.cp
    if cp > 1 and model.seq % (2 * cp):
        p.error(f"--cp {cp} needs --seq {model.seq} cut into 2 x cp = {2 * cp} equal chunks "
                "(the load-balanced layout): give a --seq that 2 x cp divides")
    if args.gpus % cp:
        p.error(f"--cp {cp} does not divide the {args.gpus} GPUs")
    if args.tp and args.pp:
        if args.gpus % (args.tp * args.pp * cp):
            what = "tp x pp" + (" x cp" if cp > 1 else "")
            p.error(f"{what} = {args.tp * args.pp * cp} does not divide the {args.gpus} GPUs")
        lay = Layout(args.tp, args.pp, args.gpus // (args.tp * args.pp * cp), args.micro_batch or 1,
                     args.chunks or 1, args.zero or 0, args.sequence_parallel, args.recompute or "none",
                     flash_attention=args.flash_attention, cp=cp, cp_variant=args.cp_variant)
        why = legal(model, cluster, lay)
        if why:
            p.error(why)
        ests = [estimate(model, cluster, lay)]
    else:
        if args.tp and (model.heads % args.tp or model.kv % args.tp):
            p.error(f"--tp {args.tp} does not divide the {model.heads} heads ({model.kv} key/value heads)")
        if args.pp and stage_layers(model.layers, args.pp) is None:
            p.error(f"--pp {args.pp} does not divide the {model.layers} layers")
        if args.gpus % ((args.tp or 1) * (args.pp or 1) * cp):
            p.error(f"tp x pp{' x cp' if cp > 1 else ''} does not divide the {args.gpus} GPUs")
        ests = search(model, cluster, top=None, tp=args.tp, pp=args.pp, **fixed)
        if not ests:
            p.error("no legal layout: dp x micro-batch must divide the global batch, tp the heads, "
                    "pp the layers" + (", and (Ulysses) cp a TP rank's heads" if cp > 1 else ""))
        if not ests[0].fits:
            p.error(f"the model fits no layout: the least memory needed is "
                    f"{min(e.memory_bytes_per_gpu for e in ests) / GB:.1f} GB per GPU, "
                    f"{args.gpu} has {cluster.gpu.memory_bytes / GB:.0f} GB")
        ests = ests[:args.top]
    if args.json:
        print(json.dumps({"model": {**model.__dict__, "params": model.params()},
                          "gpu": args.gpu, "gpus": args.gpus, "layouts": [e.as_dict() for e in ests]}))
        return 0
    print(f"{model.params() / 1e9:.1f}B parameters: {model.layers} layers, h {model.hidden}, "
          f"{model.heads} heads, s {model.seq}, batch {model.global_batch}; {args.gpus} x {args.gpu}")
    print(HEADER_CP if cp > 1 else HEADER)
    for i, e in enumerate(ests, 1):
        print(row(i, e, cp > 1))
    if cp > 1:
        print(f"seconds per step: comp(ute) incl. elementwise, exposed TP, exposed CP ({args.cp_variant}),"
              "\nbubble, PP, DP; memory on the fullest GPU; rc: recompute")
    else:
        print("seconds per step: comp(ute) incl. elementwise, exposed TP, bubble, PP, DP; memory on "
              "the fullest GPU")
    if args.explain:
        e = ests[0]
        print("the arithmetic of layout 1 (docs/reference.md#the-planner):")
        print(*describe(e), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
