"""The checkpoint command line: look inside, verify, exchange weights with nanoGPT / PyTorch.

    python -m minidist.checkpoint show CKPT                   # step, layout, tensors, pieces, files
    python -m minidist.checkpoint verify CKPT                 # exit 0 when sound, 2 with the problems
    python -m minidist.checkpoint export CKPT out.safetensors # nanoGPT names and layouts
    python -m minidist.checkpoint import in.safetensors ROOT  # a one-process checkpoint, step 0

CKPT is a checkpoint folder or a root folder of them (its `latest` is followed). None of
these needs mpi4py: they run on a laptop without MPI.

nanoGPT and minidist name the GPT's parameters alike (transformer.h.0.attn.c_attn.weight),
but a minidist Linear computes x @ W with W of shape (in, out) and PyTorch's nn.Linear
x @ W.T with W (out, in): every 2-D parameter but the two embeddings is transposed on the
way out and back in. nanoGPT's state dict also lists lm_head.weight, tied to (the same
values as) transformer.wte.weight; export adds it, import checks and drops it. Only the
model's tensors (global names "model.<param>") travel; the optimizer state stays behind.

Export writes the model's shape into the file's metadata ("nanogpt_config": the keyword
arguments of nanoGPT's GPTConfig, as JSON; "gelu": "tanh" or "erf"). nanoGPT's MLP runs
PyTorch's exact nn.GELU(); a model trained here with GPTConfig(gelu="erf") gives nanoGPT's
logits as they are, one with the default tanh GELU needs nanoGPT's GELU set to
nn.GELU(approximate="tanh") (the README shows both).

Import takes what nanoGPT users save: a safetensors file of the model's state dict, from
`safetensors.torch.save_file(model.state_dict(), ...)` (both tied names) or `save_model`
(which keeps one name of a tied pair: lm_head.weight), with or without the `_orig_mod.`
prefix torch.compile puts on every name. A PyTorch pickle (torch.save's .pt) is refused:
unpickling runs whatever code the file holds.
"""
import argparse
import json
import os
import re
import sys
import textwrap

import numpy as np

from minidist.checkpoint.format import (CheckpointError, dtype_from_name, read_header,
                                        read_safetensors, write_safetensors)
from minidist.checkpoint.index import load_index, resolve
from minidist.checkpoint.read import read_global, verify
from minidist.checkpoint.store import save

MODEL = "model."
EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")
TIED = ("lm_head.weight", "transformer.wte.weight")     # nanoGPT's name, the one it shares with
COMPILED = "_orig_mod."                                  # torch.compile's prefix
NANOGPT_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "dropout")
WIDTH = 100
# the GPT's parameter names (the dense model: an MoE model's expert tensors are not nanoGPT's)
GPT_NAME = re.compile(r"transformer\.(wte\.weight|wpe\.weight|ln_f\.(weight|bias)|h\.(\d+)\."
                      r"(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias))$")


def _transposed(name, a):
    """A Linear weight changes (in, out) <-> (out, in); embeddings, biases, norms stay."""
    return np.ascontiguousarray(a.T) if a.ndim == 2 and name not in EMBEDDINGS else a


def _region(p):
    if "box" in p:
        return "[" + ",".join(f"{a}:{b}" for a, b in p["box"]) + "]"
    return "flat[{}:{}]".format(*p["flat"])


def _say(text, indent="", more="  "):
    """Print text wrapped at WIDTH columns (continuations indented further)."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + more,
                        break_long_words=False, break_on_hyphens=False))


def _short(path):
    """The path as the reader can use it, the shorter of relative and absolute."""
    rel = os.path.relpath(path)
    return rel if len(rel) < len(os.fspath(path)) else os.fspath(path)

# ----------------------------------------------------------------------------- show, verify


def show(args):
    ckpt = resolve(args.ckpt)
    index = load_index(ckpt)
    meta = index["meta"] if isinstance(index["meta"], dict) else {}
    _say(f"{_short(ckpt)}: step {index['step']}, written by {index.get('world_size', '?')} ranks")
    _say(f"layout: {meta.get('layout')}", "  ")
    data = {k: v for k, v in meta.items() if k.startswith("data")}
    _say(f"data position: {data or None}", "  ")
    if isinstance(meta.get("model"), dict):
        _say("model: " + ", ".join(f"{k}={v}" for k, v in meta["model"].items()), "  ")
    others = [k for k in meta if k not in ("layout", "model") and not k.startswith("data")]
    if others:
        _say(f"meta also holds: {', '.join(others)}", "  ")
    ranks = {f: info["rank"] for f, info in index["files"].items()}
    print(f"  {len(index['tensors'])} tensors (pieces as rank:region):")
    for name, t in index["tensors"].items():
        pieces = " ".join(f"r{ranks.get(p['file'], '?')}:{_region(p)}" for p in t["pieces"])
        _say(f"{name} {tuple(t['shape'])} {t['dtype']}  {pieces}", "    ", "    ")
    total = sum(info["size"] for info in index["files"].values())
    print(f"  {len(index['files'])} files, {total} bytes:")
    for f, info in index["files"].items():
        _say(f"{f} {info['size']} bytes (rank {info['rank']})", "    ")
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

# ----------------------------------------------------------------------------- the model's shape


def infer_config(tensors, where):
    """nanoGPT's GPTConfig arguments read off a GPT's tensors ({minidist name: array}, Linear
    weights (in, out)); n_head is not in the shapes and is left out. A CheckpointError in one
    line when the tensors are not a GPT's weights (names, shapes, or dtype)."""
    unknown = sorted(n for n in tensors if not GPT_NAME.match(n))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(f"{where}: not a GPT's weights: {unknown[0]!r}{more} is no nanoGPT "
                              f"parameter name")
    missing = [n for n in EMBEDDINGS if n not in tensors]
    if missing:
        raise CheckpointError(f"{where}: not a GPT's weights: it has no {missing[0]!r}")
    bad = sorted(n for n, a in tensors.items() if a.dtype.kind != "f" and a.dtype.name != "bfloat16")
    if bad:
        raise CheckpointError(f"{where}: {bad[0]!r} holds {tensors[bad[0]].dtype}, not floating-point weights")
    (V, C), (T, C2) = tensors[EMBEDDINGS[0]].shape, tensors[EMBEDDINGS[1]].shape
    layers = {int(GPT_NAME.match(n).group(3)) for n in tensors if ".h." in n}
    cfg = {"n_layer": len(layers), "n_embd": C, "block_size": T, "vocab_size": V,
           "bias": "transformer.ln_f.bias" in tensors}
    if layers != set(range(len(layers))) or C2 != C:
        raise CheckpointError(f"{where}: not one GPT's weights: layers {sorted(layers)}, "
                              f"embedding widths {C} and {C2}")
    expected = {EMBEDDINGS[0]: (V, C), EMBEDDINGS[1]: (T, C), "transformer.ln_f.weight": (C,)}
    shapes = {"ln_1.weight": (C,), "ln_2.weight": (C,), "attn.c_attn.weight": (C, 3 * C),
              "attn.c_proj.weight": (C, C), "mlp.c_fc.weight": (C, 4 * C), "mlp.c_proj.weight": (4 * C, C)}
    biases = {"ln_1.bias": (C,), "ln_2.bias": (C,), "attn.c_attn.bias": (3 * C,), "attn.c_proj.bias": (C,),
              "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.bias": (C,)}
    if cfg["bias"]:
        expected["transformer.ln_f.bias"] = (C,)
        shapes.update(biases)
    for i in range(len(layers)):
        expected.update({f"transformer.h.{i}.{k}": s for k, s in shapes.items()})
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{where}: a GPT of {cfg} would have {name!r}; this file has not")
        if tuple(tensors[name].shape) != shape:
            torch = (lambda s: tuple(s)[::-1] if len(s) == 2 and name not in EMBEDDINGS else tuple(s))
            raise CheckpointError(f"{where}: {name!r} has shape {torch(tensors[name].shape)}, a GPT with "
                                  f"n_embd={C} needs {torch(shape)} (PyTorch's (out, in) layout)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: {extra[0]!r} does not belong to a GPT with bias={cfg['bias']}")
    return cfg

# ----------------------------------------------------------------------------- export, import


def export(args):
    ckpt = resolve(args.ckpt)
    index = load_index(ckpt)
    names = [n for n in index["tensors"] if n.startswith(MODEL)]
    if not names:
        raise CheckpointError(f"{ckpt}: holds no model tensors (names starting with {MODEL!r})")
    ours = {full[len(MODEL):]: read_global(ckpt, index, full) for full in names}
    shape = infer_config(ours, ckpt)
    model = index["meta"].get("model") if isinstance(index["meta"], dict) else None
    model = model if isinstance(model, dict) else {}
    config = {k: model[k] for k in NANOGPT_KEYS if k in model}
    config.update(shape)                         # the tensors' own shape wins over the metadata
    gelu = model.get("gelu", "tanh")
    out = {name: _transposed(name, a) for name, a in ours.items()}
    if args.dtype:
        dt = dtype_from_name(args.dtype)         # bfloat16: rounded to nearest even (ml_dtypes)
        out = {n: a.astype(dt) for n, a in out.items()}
    out[TIED[0]] = out[TIED[1]].copy()
    metadata = {"format": "pt", "source": f"minidist {ckpt}", "step": str(index["step"]),
                "nanogpt_config": json.dumps(config), "gelu": gelu}
    write_safetensors(args.out, out, metadata)
    dtypes = sorted({a.dtype.name for a in out.values()})
    _say(f"wrote {args.out}: {len(out)} tensors ({', '.join(dtypes)}; nanoGPT names, Linear weights as "
         f"(out, in))")
    if "n_head" in config:
        args_ = ", ".join(f"{k}={config[k]!r}" for k in NANOGPT_KEYS if k in config)
        _say(f"nanoGPT: GPTConfig({args_})", "  ")
        _say(f"GELU: {gelu}" + (" (nanoGPT's MLP runs nn.GELU(), erf: give it nn.GELU(approximate="
                                "'tanh') for equal logits, as the README shows)" if gelu == "tanh"
                                else " (x Phi(x), as nanoGPT's nn.GELU())"), "  ")
    else:
        _say(f"  the checkpoint does not say n_head: give it to nanoGPT's GPTConfig yourself; GELU {gelu}")
    return 0


def _read_weights(path):
    """read_safetensors(path); a file that is not safetensors gets one line, and a PyTorch
    pickle (a zip since PyTorch 1.6, a bare pickle before) says how to convert it."""
    try:
        return read_safetensors(path)
    except CheckpointError:
        with open(path, "rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04" or head[:1] == b"\x80":
            raise CheckpointError(f"{path}: a PyTorch pickle (torch.save), which minidist does not load "
                                  f"(unpickling runs the file's code): write it with safetensors.torch."
                                  f"save_model(model, PATH)") from None
        raise


def nanogpt_state(tensors, where):
    """A nanoGPT state dict ({name: array}, PyTorch's layouts) as minidist's model tensors
    ({name: array}, Linear weights (in, out)). Handles torch.compile's `_orig_mod.` prefix,
    the tied pair saved under both names or only as lm_head.weight, and the causal-mask
    buffers (attn.bias, (1, 1, T, T)) nanoGPT keeps without flash attention."""
    tensors = {n[len(COMPILED):] if n.startswith(COMPILED) else n: a for n, a in tensors.items()}
    head, wte = (tensors.get(n) for n in TIED)
    if head is not None:
        if wte is not None and not np.array_equal(head, wte):
            raise CheckpointError(f"{where}: {TIED[0]} differs from {TIED[1]}; minidist's GPT ties them")
        tensors[TIED[1]] = tensors.pop(TIED[0])   # save_model keeps lm_head.weight only
    tensors = {n: a for n, a in tensors.items() if not (n.endswith(".attn.bias") and a.ndim == 4)}
    if not tensors:
        raise CheckpointError(f"{where}: holds no tensors")
    return {name: _transposed(name, a) for name, a in tensors.items()}


def import_(args):
    tensors = nanogpt_state(_read_weights(args.file), args.file)
    shape = infer_config(tensors, args.file)
    up = {n for n, a in tensors.items() if a.dtype.itemsize < 4}     # float16, bfloat16
    tensors = {n: a.astype(np.float32) if n in up else a for n, a in tensors.items()}
    pieces = [{"name": MODEL + name, "global_shape": a.shape, "dtype": a.dtype,
               "box": [[0, n] for n in a.shape], "array": np.ascontiguousarray(a)} for name, a in tensors.items()]
    file_meta = read_header(args.file).get("__metadata__", {}) or {}
    model = dict(shape)
    try:
        model.update(json.loads(file_meta.get("nanogpt_config", "{}")))
    except (TypeError, ValueError):
        pass
    if file_meta.get("gelu") in ("tanh", "erf"):
        model["gelu"] = file_meta["gelu"]
    meta = {"layout": {"kind": "single"}, "step": 0, "model": model,
            "source": file_meta.get("source", os.fspath(args.file))}
    path = save(None, args.root, 0, pieces, meta)
    note = f" ({len(up)} 16-bit tensors widened to float32)" if up else ""
    _say(f"wrote {path}: {len(pieces)} tensors{note}, one process, step 0, no optimizer state")
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
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="convert the weights (default: as saved; bfloat16 rounds to nearest even)")
    p.set_defaults(run=export)
    p = sub.add_parser("import", help="a nanoGPT state dict (safetensors) into a one-process checkpoint")
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
