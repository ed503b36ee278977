"""What a checkpoint is on disk, and the rules that saving and reading both keep.

A checkpoint holds GLOBAL tensors (the single-process model's parameters and optimizer
state, by name); the ranks hold them in pieces, each either a box, {"box": [[start, stop],
...]} one pair per dimension (tensor parallelism's shards), or a flat range, {"flat":
[start, stop]} of the tensor flattened in C order (ZeRO's partitions). Each piece of each
tensor is written by exactly one rank (the caller drops replicas); the coverage check
below makes sure of it.

On disk (root/ holds many steps; `latest` names the newest):

    root/latest                      "step00000200"
    root/step00000200/index.json     step, meta, every tensor's shape, dtype and pieces
                                     (file, key, box or flat), every file's size and sha256
    root/step00000200/rank00003.safetensors   rank 3's pieces, keys "NAME@0", "NAME@1", ...

Coverage is counted with one uint8 per element of each global tensor, on rank 0 only:
simple, and at this course's model sizes a few MB. store.py writes this layout (save),
read.py reads it; both take its rules from here.
"""
import json
import os
import re

import numpy as np

from minidist.checkpoint.format import CheckpointError

FORMAT, VERSION = "minidist-checkpoint", 1
STEP_DIR = re.compile(r"^step(\d{8,})$")


def step_dir(step):
    return f"step{step:08d}"


# ---- pieces: validation, regions, coverage ----

def region_shape(piece, shape):
    if "box" in piece:
        return tuple(b - a for a, b in piece["box"])
    a, b = piece["flat"]
    return (b - a,)


def check_piece(p, where):
    """A piece as the caller gave it, checked against its own global shape: a list of problems."""
    name, shape = p.get("name"), tuple(p.get("global_shape", ()))
    if ("box" in p) == ("flat" in p):
        return [f"{where}: piece of {name!r} needs exactly one of 'box' and 'flat'"]
    if "box" in p:
        box = [tuple(int(v) for v in pair) for pair in p["box"]]
        if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
            return [f"{where}: piece of {name!r} has box {box}, outside its global shape {shape}"]
    else:
        a, b = (int(v) for v in p["flat"])
        if not 0 <= a <= b <= int(np.prod(shape, dtype=np.int64)):
            return [f"{where}: piece of {name!r} has flat range [{a}, {b}), outside its "
                    f"{int(np.prod(shape, dtype=np.int64))} elements"]
    return []


def _coverage(name, shape, pieces):
    """Problems with how `pieces` cover the tensor: every element exactly once, or a message."""
    count = np.zeros(shape, np.uint8)
    for p in pieces:
        if "box" in p:
            count[tuple(slice(a, b) for a, b in p["box"])] += 1
        else:
            a, b = p["flat"]
            count.reshape(-1)[a:b] += 1
    flat = count.reshape(-1)
    gaps, overlaps = np.flatnonzero(flat == 0), np.flatnonzero(flat > 1)
    problems = []
    for what, where in (("not covered by any piece", gaps), ("covered by more than one piece", overlaps)):
        if where.size:
            first = tuple(int(i) for i in np.unravel_index(where[0], shape))
            problems.append(f"tensor {name!r}: {where.size} of {flat.size} elements {what} "
                            f"(the first at index {first}): a layout bug, nothing was published")
    return problems


def check_coverage(index):
    """Problems with the coverage of every tensor of an index (an empty list when all is well)."""
    problems = []
    for name, t in index["tensors"].items():
        problems += _coverage(name, tuple(t["shape"]), t["pieces"])
    return problems


# ---- finding a checkpoint and its index ----

def resolve(path):
    """The checkpoint folder `path` means: itself (it holds index.json), or what its `latest` names."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "index.json")):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder")
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        raise CheckpointError(f"{path}: not a checkpoint (no index.json) nor a folder of them (no latest)")
    with open(latest) as f:
        name = f.read().strip()
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{latest}: names {name!r}, not a checkpoint folder such as step00000100")
    folder = os.path.join(path, name)
    if not os.path.isfile(os.path.join(folder, "index.json")):
        raise CheckpointError(f"{latest} names {name}, but {folder}/index.json does not exist")
    return folder


def load_index(path):
    """The parsed index.json of the checkpoint `path` resolves to, its format checked."""
    file = os.path.join(resolve(path), "index.json")
    try:
        with open(file) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read as JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a minidist checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{file}: format version {index.get('version')}, this minidist reads {VERSION}")
    missing = [k for k in ("step", "meta", "tensors", "files") if k not in index]
    if missing:
        raise CheckpointError(f"{file}: lacks {', '.join(missing)}")
    return index


def check_against(index, expected, extra_ok=False):
    """Raise a CheckpointError naming the first tensor missing, extra, or of another shape/dtype.

    expected: {name: (shape, dtype)}, what the model being loaded into holds. extra_ok:
    the checkpoint may hold more (one pipeline stage holds some layers; the caller checks
    that every tensor is held by some rank)."""
    have = index["tensors"]
    for name, (shape, dtype) in expected.items():
        if name not in have:
            raise CheckpointError(f"the checkpoint has no tensor {name!r} (another model?)")
        t = have[name]
        if (tuple(t["shape"]), t["dtype"]) != (tuple(shape), np.dtype(dtype).name):
            raise CheckpointError(f"tensor {name!r}: the checkpoint holds {tuple(t['shape'])} {t['dtype']}, "
                                  f"the model {tuple(shape)} {np.dtype(dtype).name} (another model?)")
    extra = [name for name in have if name not in expected]
    if extra and not extra_ok:
        raise CheckpointError(f"the checkpoint holds {extra[0]!r}, which the model lacks (another model?)")


