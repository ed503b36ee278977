"""The memory calculator: bytes per device of training with Adam, by ZeRO stage, and the
activations per layer by Korthikanti et al.'s formulas; sizes far beyond this machine.

    python -m minidist.memory --params 7.5e9 --dp 64
    python -m minidist.memory --params 70e9 --dp 8 --seq 4096 --batch 1 --hidden 8192 \
        --heads 64 --layers 80 --tp 8 --sequence-parallel --recompute selective --json

Model states, mixed-precision Adam as the ZeRO paper counts them (Rajbhandari et al.
2020, docs/reference.md#zero-memory-and-communication): 2 bytes of fp16/bf16 weights,
2 of gradients, K = 12 of fp32 master weights, momentum and variance per parameter:
stage 0 (data parallelism) (2+2+K) Psi; 1: 4 Psi + K Psi/N; 2: 2 Psi + (2+K) Psi/N;
3: (2+2+K) Psi/N. The paper's example, 7.5B on 64 devices: 120, 31.4, 16.6, 1.9 GB.
With --tp t and --pp p each device holds Psi/(t p) of the parameters (tensor parallelism
splits every matrix, the pipeline splits the layers; evenly, ignoring the few replicated
ones such as layer norms), and the stages above apply to that share, N = N_d.

Activations per layer (docs/reference.md#activation-memory-per-layer): 16-bit values,
1-byte dropout masks, plan.memory.korthikanti_layer_bytes for none; selective
recomputation drops the 5as^2b attention term; full keeps each layer's input, 2sbh
(divided by t under sequence parallelism). The formulas live in minidist/plan/memory.py;
this file is their command line.
"""
import argparse
import json
import math
import sys

from minidist.plan.memory import ACCOUNTING, activation_layer_bytes, model_state_bytes
from minidist.plan.rules import parameter_count

K_ADAM = ACCOUNTING["zero"][2]   # fp32 master weights, momentum, variance: bytes per parameter
GB = 1e9           # the paper's GB


def _positive(kind):
    def parse(text):
        try:
            v = kind(float(text)) if kind is int else float(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        if not math.isfinite(v) or v <= 0 or (kind is int and float(text) != v):
            raise argparse.ArgumentTypeError(f"expected a positive {'whole ' if kind is int else ''}number, got {text!r}")
        return v
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, exit 2 (the usage is under --help)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    p = _Parser(prog="python -m minidist.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parameter_count, required=True,
                   help="parameter count Psi: 7.5e9, 7.5B, 350M or 1.2T")
    p.add_argument("--dp", type=_positive(int), required=True, help="data-parallel devices N_d")
    for name, helptext in (("seq", "sequence length s"), ("batch", "micro-batch b"), ("hidden", "hidden size h"),
                           ("heads", "attention heads a"), ("layers", "layers L")):
        p.add_argument(f"--{name}", type=_positive(int), help=helptext)
    p.add_argument("--tp", type=_positive(int), default=1,
                   help="tensor-parallel size t (default 1): divides the model states (Psi/t per device) "
                        "and the activations")
    p.add_argument("--pp", type=_positive(int), default=1,
                   help="pipeline stages p (default 1): divides the model states (Psi/p per device); "
                        "the activations stay those of the layers given")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    psi = args.params / (args.tp * args.pp)          # this device's share of the parameters
    states = {stage: sum(model_state_bytes(psi, args.dp, stage).values()) for stage in range(4)}
    shape = [args.seq, args.batch, args.hidden, args.heads, args.layers]
    acts = None
    if any(v is not None for v in shape):
        if any(v is None for v in shape):
            p.error("activations need all of --seq, --batch, --hidden, --heads and --layers")
        per_layer = activation_layer_bytes(args.seq, args.batch, args.hidden, args.heads, args.tp,
                                           args.sequence_parallel, args.recompute)
        acts = {"per_layer": per_layer, "total": per_layer * args.layers, "tp": args.tp,
                "sequence_parallel": args.sequence_parallel, "recompute": args.recompute}
    if args.json:
        print(json.dumps({"params": args.params, "dp": args.dp, "tp": args.tp, "pp": args.pp,
                          "params_per_device": psi,
                          "bytes_per_device": {str(k): v for k, v in states.items()}, "activations": acts}))
        return 0
    print(f"model states per device, mixed-precision Adam (2 + 2 + {K_ADAM} bytes per parameter),")
    print(f"  Psi = {args.params:g}, N_d = {args.dp}")
    if args.tp * args.pp > 1:
        print(f"  t = {args.tp} x p = {args.pp}: Psi/(t p) = {psi:g} per device, the Psi below")
    labels = {0: "data parallel", 1: "ZeRO stage 1", 2: "ZeRO stage 2", 3: "ZeRO stage 3"}
    formulas = {0: "(2+2+K) Psi", 1: "4 Psi + K Psi/N_d", 2: "2 Psi + (2+K) Psi/N_d", 3: "(2+2+K) Psi/N_d"}
    for s in range(4):
        print(f"  stage {s}  {labels[s]:<14} {formulas[s]:<22} {states[s] / GB:10.2f} GB")
    if acts:
        print(f"activations (Korthikanti et al. 2022; t = {args.tp}"
              f"{', sequence parallel' if args.sequence_parallel else ''}, recompute {args.recompute})")
        print(f"  per layer {acts['per_layer'] / GB:10.3f} GB   all {args.layers} layers {acts['total'] / GB:10.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
