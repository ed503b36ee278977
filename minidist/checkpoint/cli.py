"""The checkpoint command line: look inside, verify, exchange weights with nanoGPT / PyTorch.

    python -m minidist.checkpoint show CKPT                   # step, layout, tensors, pieces, files
    python -m minidist.checkpoint verify CKPT                 # exit 0 when sound, 2 with the problems
    python -m minidist.checkpoint export CKPT out.safetensors # nanoGPT names and layouts
    python -m minidist.checkpoint import in.safetensors ROOT  # a one-process checkpoint, step 0

CKPT is a checkpoint folder or a root folder of them (its `latest` is followed).

nanoGPT and minidist name the GPT's parameters alike (transformer.h.0.attn.c_attn.weight),
but a minidist Linear computes x @ W with W of shape (in, out) and PyTorch's nn.Linear
x @ W.T with W (out, in): every 2-D parameter but the two embeddings is transposed on the
way out and back in. nanoGPT's state dict also lists lm_head.weight, tied to (the same
values as) transformer.wte.weight; export adds it, import checks and drops it. Only the
model's tensors (global names "model.<param>") travel; the optimizer state stays behind.
"""
import argparse
import sys

import numpy as np

from minidist.checkpoint.format import CheckpointError, read_header, read_safetensors, write_safetensors
from minidist.checkpoint.store import load_index, read_global, resolve, save, verify

MODEL = "model."
EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")
TIED = ("lm_head.weight", "transformer.wte.weight")     # nanoGPT's name, the one it shares with


def _transposed(name, a):
    """A Linear weight changes (in, out) <-> (out, in); embeddings, biases, norms stay."""
    return np.ascontiguousarray(a.T) if a.ndim == 2 and name not in EMBEDDINGS else a


def _region(p):
    if "box" in p:
        return "[" + ",".join(f"{a}:{b}" for a, b in p["box"]) + "]"
    return "flat[{}:{}]".format(*p["flat"])


def show(args):
    ckpt = resolve(args.ckpt)
    index = load_index(ckpt)
    meta = index["meta"] if isinstance(index["meta"], dict) else {}
    print(f"{ckpt}: step {index['step']}, written by {index.get('world_size', '?')} ranks")
    print(f"  layout: {meta.get('layout')}")
    data = {k: v for k, v in meta.items() if k.startswith("data")}
    print(f"  data position: {data or None}")
    others = [k for k in meta if k != "layout" and not k.startswith("data")]
    if others:
        print(f"  meta also holds: {', '.join(others)}")
    ranks = {f: info["rank"] for f, info in index["files"].items()}
    print(f"  {len(index['tensors'])} tensors (pieces as rank:region):")
    for name, t in index["tensors"].items():
        pieces = " ".join(f"r{ranks.get(p['file'], '?')}:{_region(p)}" for p in t["pieces"])
        print(f"    {name} {tuple(t['shape'])} {t['dtype']}  {pieces}")
    total = sum(info["size"] for info in index["files"].values())
    print(f"  {len(index['files'])} files, {total} bytes:")
    for f, info in index["files"].items():
        print(f"    {f} {info['size']} bytes (rank {info['rank']})")
    return 0


def verify_command(args):
    problems = verify(args.ckpt)
    if problems:
        for line in problems[:10]:
            print(line)
        if len(problems) > 10:
            print(f"... and {len(problems) - 10} more problems")
        return 2
    index = load_index(args.ckpt)
    total = sum(info["size"] for info in index["files"].values())
    print(f"ok: {len(index['files'])} files, {len(index['tensors'])} tensors, {total} bytes verified")
    return 0


def export(args):
    ckpt = resolve(args.ckpt)
    index = load_index(ckpt)
    names = [n for n in index["tensors"] if n.startswith(MODEL)]
    if not names:
        raise CheckpointError(f"{ckpt}: holds no model tensors (names starting with {MODEL!r})")
    out = {}
    for full in names:
        name = full[len(MODEL):]
        out[name] = _transposed(name, read_global(ckpt, index, full))
    if TIED[1] in out:
        out[TIED[0]] = out[TIED[1]].copy()
    write_safetensors(args.out, out, {"format": "pt", "source": f"minidist {ckpt}", "step": str(index["step"])})
    print(f"wrote {args.out}: {len(out)} tensors (nanoGPT names, Linear weights as (out, in))")
    return 0


def import_(args):
    tensors = read_safetensors(args.file)
    if TIED[0] in tensors:
        if TIED[1] in tensors and not np.array_equal(tensors[TIED[0]], tensors[TIED[1]]):
            raise CheckpointError(f"{args.file}: {TIED[0]} differs from {TIED[1]}; minidist's GPT ties them")
        del tensors[TIED[0]]
    # nanoGPT without flash attention also saves its causal mask as a buffer, attn.bias (1, 1, T, T)
    tensors = {n: a for n, a in tensors.items() if not (n.endswith(".attn.bias") and a.ndim == 4)}
    pieces = [{"name": MODEL + name, "global_shape": a.T.shape if a.ndim == 2 and name not in EMBEDDINGS else a.shape,
               "dtype": a.dtype, "box": None, "array": _transposed(name, a)} for name, a in tensors.items()]
    for p in pieces:
        p["box"] = [[0, n] for n in p["global_shape"]]
    meta = {"layout": {"kind": "single"}, "step": 0,
            "source": read_header(args.file).get("__metadata__", {}).get("source", args.file)}
    path = save(None, args.root, 0, pieces, meta)
    print(f"wrote {path}: {len(pieces)} tensors, one process, step 0, no optimizer state")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minidist.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("show", help="step, layout, tensors and who wrote which piece")
    p.add_argument("ckpt")
    p.set_defaults(run=show)
    p = sub.add_parser("verify", help="every file against the index: sizes, sha256, pieces, coverage")
    p.add_argument("ckpt")
    p.set_defaults(run=verify_command)
    p = sub.add_parser("export", help="one safetensors file with nanoGPT's names and layouts")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.set_defaults(run=export)
    p = sub.add_parser("import", help="a nanoGPT-style safetensors file into a one-process checkpoint")
    p.add_argument("file")
    p.add_argument("root")
    p.set_defaults(run=import_)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
