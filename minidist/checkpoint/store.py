"""Sharded checkpoints that survive a kill: every rank writes its pieces, rank 0 publishes.

    from minidist.checkpoint.store import save, resolve, load_index, read_global, verify
    path = save(comm, "ckpt", step, pieces, meta, keep=3)      # on every rank
    index = load_index("ckpt"); w = read_global(resolve("ckpt"), index, "model.transformer.wte.weight")

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

Saving, and why each step is where it is (a kill may come at any moment):
    1. rank 0 refuses an existing step and makes root/.tmp-stepNNNNNNNN-TOKEN/ (the token
       is broadcast: every rank writes into the same folder, one a previous kill left
       behind is never reused);
    2. every rank writes its file and fsyncs it (the data is on disk before anything
       names it); the ranks agree that all writes succeeded;
    3. rank 0 gathers each rank's index fragment (JSON bytes: lengths with Gather, bytes
       with Gatherv), checks coverage, writes index.json and fsyncs it;
    4. os.rename of the folder to root/stepNNNNNNNN, fsync of root: the checkpoint appears
       whole or not at all (a rename within one file system is atomic);
    5. latest.tmp written and fsynced, then os.replace onto latest: `latest` names the old
       checkpoint or the new one, never nothing;
    6. checkpoints beyond `keep` (oldest first, never the one `latest` names) and
       leftover .tmp-* folders are deleted.
A kill before 5 leaves `latest` on the previous checkpoint (a stray folder at most, which
resolve and verify ignore and the next save removes); a kill after it leaves the new one.
An error on any rank at any stage becomes the same CheckpointError on every rank (one
small Allreduce, then the failing rank's message broadcast), and nothing is published.
The environment variable MINIDIST_CKPT_KILL_AT=after-data|after-index|after-rename|
after-latest makes save kill its own process there (SIGKILL), for the tests;
MINIDIST_CKPT_KILL_RANK=r makes only rank r of a job die (after-data is on every rank,
the later stages on rank 0).

Reading a region (read_region) opens only the files whose pieces overlap it, and from a
piece of another kind (a TP box out of ZeRO's flat ranges, or the reverse) reads only
the overlapping bytes: both regions become runs of the flattened tensor (flat_runs), the
runs are intersected (overlap_runs) and each overlap is one seek and read
(format.read_ranges). READS counts the bytes needed, read, and read for checksums.

Coverage is counted with one uint8 per element of each global tensor, on rank 0 only:
simple, and at this course's model sizes a few MB. Reading checks each file's size and
sha256 against the index the first time this process reads it (verdicts are cached), so
a flipped byte, a truncated or a missing file is an error that names the file.
"""
import json
import os
import re
import secrets
import shutil
import signal
import sys

import numpy as np

from minidist.checkpoint.format import (NAMES, CheckpointError, dtype_from_name, read_header,
                                        read_ranges, read_tensor, sha256_of, write_safetensors)

FORMAT, VERSION = "minidist-checkpoint", 1
STEP_DIR = re.compile(r"^step(\d{8,})$")
KILL_STAGES = ("after-data", "after-index", "after-rename", "after-latest")


def step_dir(step):
    return f"step{step:08d}"


def _kill_point(stage, rank=0):
    """The tests' hook: die here, as a machine losing power or a job killed by the scheduler would.
    MINIDIST_CKPT_KILL_RANK=r limits it to rank r of the job (default: whichever rank gets here)."""
    if os.environ.get("MINIDIST_CKPT_KILL_AT") == stage and \
            os.environ.get("MINIDIST_CKPT_KILL_RANK", str(rank)) == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path):
    """A rename or a new file is durable only once its folder is fsynced (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- agreement between ranks (comm=None: one process, nothing to agree) ----

def _waiting(what):
    """minidist's watchdog (minidist/comm/watchdog.py) reports a rank stuck here, with every stack."""
    from minidist.comm.watchdog import waiting     # late: a save by one process needs no MPI
    return waiting(what)


def _agree(comm, error):
    """Every rank raises the same CheckpointError if any rank's `error` (a str) is set.

    One Allreduce (MIN) finds the lowest failing rank; that rank broadcasts its message's
    length, then its bytes. Buffer methods only."""
    if comm is None:
        if error is not None:
            raise CheckpointError(error)
        return
    from mpi4py import MPI
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = np.array([rank if error is not None else size], np.int64)
    lowest = np.empty_like(mine)
    with _waiting("checkpoint: the ranks agree on an error"):
        comm.Allreduce(mine, lowest, op=MPI.MIN)
    first = int(lowest[0])
    if first == size:
        return
    text = np.frombuffer((error or "").encode(), np.uint8) if rank == first else None
    length = np.array([0 if text is None else text.size], np.int64)
    with _waiting("checkpoint: the error's text"):
        comm.Bcast(length, root=first)
        buf = text.copy() if rank == first else np.empty(int(length[0]), np.uint8)
        comm.Bcast(buf, root=first)
    where = f"rank {first}: " if size > 1 else ""
    raise CheckpointError(where + buf.tobytes().decode())


def _attempt(fn, *args):
    """(result, None), or (None, a one-line message) when fn raised: the message is agreed next."""
    try:
        return fn(*args), None
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:                # an OSError, a bad piece: every rank must hear of it
        return None, f"{type(e).__name__}: {e}"


# ---- pieces: validation, regions, coverage ----

def _region_shape(piece, shape):
    if "box" in piece:
        return tuple(b - a for a, b in piece["box"])
    a, b = piece["flat"]
    return (b - a,)


def _check_piece(p, where):
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


# ---- save ----

def _prepare(root, step):
    """Rank 0: refuse an existing step, make the temporary folder; returns its name."""
    os.makedirs(root, exist_ok=True)
    if os.path.exists(os.path.join(root, step_dir(step))):
        raise CheckpointError(f"{os.path.join(root, step_dir(step))} already exists: a checkpoint "
                              "is never overwritten; delete it or save under another step")
    tmp = f".tmp-{step_dir(step)}-{secrets.token_hex(4)}"
    os.mkdir(os.path.join(root, tmp))
    return tmp


def _write_rank(folder, rank, pieces):
    """This rank's file and its index fragment (the pieces without their arrays)."""
    fname = f"rank{rank:05d}.safetensors"
    tensors, fragment, seen = {}, [], {}
    for i, p in enumerate(pieces):
        problems = _check_piece(p, f"piece {i}")
        if problems:
            raise CheckpointError(problems[0])
        name, shape = p["name"], tuple(int(n) for n in p["global_shape"])
        dtype, a = np.dtype(p["dtype"]), np.asarray(p["array"])
        want = _region_shape(p, shape)
        if a.dtype != dtype:
            raise CheckpointError(f"piece {i} of {name!r}: array of dtype {a.dtype}, the tensor is {dtype}")
        if a.shape != want and not ("flat" in p and a.size == want[0]):
            raise CheckpointError(f"piece {i} of {name!r}: array of shape {a.shape}, its region is {want}")
        key = f"{name}@{seen.get(name, 0)}"
        seen[name] = seen.get(name, 0) + 1
        tensors[key] = a.reshape(want)
        entry = {"name": name, "shape": list(shape), "dtype": dtype.name, "key": key, "file": fname}
        if "box" in p:
            entry["box"] = [[int(a_), int(b_)] for a_, b_ in p["box"]]
        else:
            entry["flat"] = [int(v) for v in p["flat"]]
        fragment.append(entry)
    size, sha = write_safetensors(os.path.join(folder, fname), tensors,
                                  {"format": "pt", "minidist": f"rank {rank} of a checkpoint"})
    return {"file": fname, "rank": rank, "size": size, "sha256": sha, "pieces": fragment}


def _gather_fragments(comm, fragment):
    """Rank 0 gets every rank's fragment: lengths with Gather, the JSON bytes with Gatherv."""
    mine = np.frombuffer(json.dumps(fragment).encode(), np.uint8)
    if comm is None:
        return [fragment]
    size, rank = comm.Get_size(), comm.Get_rank()
    lengths = np.zeros(size, np.int64) if rank == 0 else None
    with _waiting("checkpoint save: gather the index"):
        comm.Gather(np.array([mine.size], np.int64), lengths, root=0)
        if rank != 0:
            comm.Gatherv(mine, None, root=0)
            return None
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        everything = np.empty(int(lengths.sum()), np.uint8)
        comm.Gatherv(mine, [everything, lengths, offsets, _mpi_byte()], root=0)
    return [json.loads(everything[o:o + n].tobytes()) for o, n in zip(offsets, lengths)]


def _mpi_byte():
    from mpi4py import MPI
    return MPI.BYTE


def _build_index(step, meta, fragments):
    tensors, files = {}, {}
    for f in fragments:
        files[f["file"]] = {"rank": f["rank"], "size": f["size"], "sha256": f["sha256"]}
        for p in f["pieces"]:
            t = tensors.setdefault(p["name"], {"shape": p["shape"], "dtype": p["dtype"], "pieces": []})
            if (t["shape"], t["dtype"]) != (p["shape"], p["dtype"]):
                raise CheckpointError(f"tensor {p['name']!r}: {p['file']} says shape {p['shape']} "
                                      f"{p['dtype']}, another rank said {t['shape']} {t['dtype']}")
            t["pieces"].append({k: p[k] for k in ("file", "key", "box", "flat") if k in p})
    index = {"format": FORMAT, "version": VERSION, "step": step, "world_size": len(fragments),
             "meta": meta, "tensors": tensors, "files": files}
    problems = check_coverage(index)
    if problems:
        raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    return index


def _publish(root, tmp, step, meta, fragments, keep, require=None):
    """Rank 0: index, rename, latest, cleanup; stages 3-6 of the docstring."""
    folder = os.path.join(root, tmp)
    index = _build_index(step, meta, fragments)
    missing = sorted(set(require or ()) - set(index["tensors"]))
    if missing:                       # coverage sees only the tensors some rank wrote
        raise CheckpointError(f"no rank wrote tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if
                              len(missing) > 1 else "") + ": a layout lost it; nothing is published")
    try:
        text = json.dumps(index, indent=1)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta must be JSON-able (numbers, strings, lists, dicts): {e}") from None
    with open(os.path.join(folder, "index.json"), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)
    _kill_point("after-index")
    final = step_dir(step)
    os.rename(folder, os.path.join(root, final))
    _fsync_dir(root)
    _kill_point("after-rename")
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(final + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _fsync_dir(root)
    _kill_point("after-latest")
    for name in os.listdir(root):                         # what earlier kills left behind
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if keep is not None:
        steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name)))
        old = [name for _, name in steps if name != final][:max(0, len(steps) - max(keep, 1))]
        for name in old:                                  # oldest first; the new one is published
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)   # already: never fail it now
    return os.path.join(root, final)


def save(comm, root, step, pieces, meta, keep=None, require=None):
    """Write this rank's `pieces` into a new checkpoint of `step` under `root`; on every rank.

    pieces: [{"name", "global_shape", "dtype", "box" or "flat", "array"}], this rank's share.
    meta: a JSON-able dict (layout, model config, data position, RNG states, ...); rank 0's
        is the one written (every rank passes its own; only rank 0 reads it).
    require: names of tensors the checkpoint must hold (rank 0's; the caller's model's):
        one that no rank wrote is an error, not a checkpoint that lacks it.
    keep: keep this many newest checkpoints (None: all). comm None: one process alone.
    Returns root/stepNNNNNNNN on every rank; raises the same CheckpointError on every rank.
    """
    rank = 0 if comm is None else comm.Get_rank()
    token = np.zeros(64, np.uint8)                        # the folder's name, broadcast
    if rank == 0:
        tmp, error = _attempt(_prepare, root, int(step))
        if tmp:
            token[:len(tmp)] = np.frombuffer(tmp.encode(), np.uint8)
    else:
        error = None
    _agree(comm, error)
    if comm is not None:
        with _waiting("checkpoint save: the folder's name"):
            comm.Bcast(token, root=0)
    tmp = token.tobytes().rstrip(b"\0").decode()
    folder = os.path.join(root, tmp)
    try:
        fragment, error = _attempt(_write_rank, folder, rank, pieces)
        _kill_point("after-data", rank)
        _agree(comm, error)
        fragments = _gather_fragments(comm, fragment)
        path, error = (_attempt(_publish, root, tmp, int(step), meta, fragments, keep, require) if rank == 0
                       else (None, None))
        _agree(comm, error)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)     # nothing published: leave no trace
        raise
    return os.path.join(root, step_dir(int(step)))


# ---- finding and reading ----

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


_verdicts = {}     # (path, sha256, size, mtime) -> header, or the CheckpointError message

# What this process's reads cost, in bytes (reset_reads() starts again): "needed", the
# regions asked for; "read", the tensor bytes read from files to build them; "checked",
# the whole files read once each to check their sha256 against the index.
READS = {"needed": 0, "read": 0, "checked": 0}


def reset_reads():
    """Zero READS; returns its values before."""
    before = dict(READS)
    READS.update(needed=0, read=0, checked=0)
    return before


def _checked_header(ckpt, index, fname):
    """The file's header, after checking its size and sha256 against the index (once per process)."""
    path = os.path.join(ckpt, fname)
    want = index["files"].get(fname)
    if want is None:
        raise CheckpointError(f"{ckpt}/index.json names no file {fname}")
    try:
        st = os.stat(path)
    except OSError:
        raise CheckpointError(f"{path}: missing (the index lists it, {want['size']} bytes)") from None
    key = (os.path.abspath(path), want["sha256"], st.st_size, st.st_mtime_ns)
    if key not in _verdicts:
        if st.st_size != want["size"]:
            _verdicts[key] = f"{path}: {st.st_size} bytes, the index says {want['size']}: truncated, appended to or replaced"
        elif _counted_sha256(path, st.st_size) != want["sha256"]:
            _verdicts[key] = f"{path}: its sha256 differs from the index's: the file is corrupted"
        else:
            try:
                _verdicts[key] = read_header(path)
            except CheckpointError as e:
                _verdicts[key] = str(e)
    verdict = _verdicts[key]
    if isinstance(verdict, str):
        raise CheckpointError(verdict)
    return verdict


def _counted_sha256(path, size):
    READS["checked"] += size
    return sha256_of(path)


def _tensor_entry(index, name):
    if name not in index["tensors"]:
        raise CheckpointError(f"the checkpoint holds no tensor {name!r}")
    t = index["tensors"][name]
    return t, tuple(t["shape"]), dtype_from_name(t["dtype"])


def _read_piece(ckpt, index, p):
    fname = p["file"]
    data = read_tensor(os.path.join(ckpt, fname), p["key"], _checked_header(ckpt, index, fname))
    READS["read"] += data.nbytes
    return data


def read_global(ckpt, index, name):
    """The whole global tensor `name`, assembled from its pieces."""
    t, shape, dtype = _tensor_entry(index, name)
    out = np.empty(shape, dtype)
    READS["needed"] += out.nbytes
    for p in t["pieces"]:
        data = _read_piece(ckpt, index, p)
        if "box" in p:
            out[tuple(slice(a, b) for a, b in p["box"])] = data
        else:
            a, b = p["flat"]
            out.reshape(-1)[a:b] = data.reshape(-1)
    return out


def copy_overlap(out, out_box, piece, piece_box):
    """Resharding one tensor, one piece at a time: `out` holds the region `out_box` of a
    global tensor, `piece` the region `piece_box` (each a [start, stop] per dimension);
    copy into `out` the part of `piece` that lies inside out_box, in place. Returns
    True when the two regions overlap. (Exercise 11.2.)"""
    inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(out_box, piece_box)]
    if any(lo >= hi for lo, hi in inter):
        return False
    out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, out_box))] = \
        piece[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, piece_box))]
    return True


def flat_runs(region, shape):
    """A region of a tensor of `shape` as runs of the tensor flattened in C order:
    (starts, lengths), two int64 arrays, increasing. A flat range is one run; a box is one
    run per row of its leading dimensions, the trailing dimensions it spans whole merged
    into each run (a box of whole rows is one run)."""
    if "flat" in region:
        a, b = (int(v) for v in region["flat"])
        return np.array([a], np.int64), np.array([b - a], np.int64)
    box = [(int(a), int(b)) for a, b in region["box"]]
    if not shape:
        return np.array([0], np.int64), np.array([1], np.int64)
    if any(b <= a for a, b in box):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1                            # dimensions k+1.. are whole: part of every run
    starts = np.zeros(1, np.int64)
    for j in range(k):
        starts = (starts[:, None] + np.arange(*box[j], dtype=np.int64)[None, :] * strides[j]).reshape(-1)
    starts += box[k][0] * strides[k]
    return starts, np.full(starts.size, (box[k][1] - box[k][0]) * strides[k], np.int64)


def overlap_runs(want, have):
    """Where two regions' runs meet: [(position in want's elements, position in have's
    elements, count)], in increasing order. want, have: (starts, lengths) of flat_runs;
    a region's elements are its runs end to end (a box's in C order, as a piece stores it)."""
    (ws, wl), (hs, hl) = want, have
    wo = np.concatenate([[0], np.cumsum(wl)[:-1]]).astype(np.int64)
    ho = np.concatenate([[0], np.cumsum(hl)[:-1]]).astype(np.int64)
    out = []
    swap = ws.size < hs.size              # loop over the shorter list, vectorised over the other
    (ls, ll, lo_), (vs, vl, vo) = ((ws, wl, wo), (hs, hl, ho)) if swap else ((hs, hl, ho), (ws, wl, wo))
    for s, n, o in zip(ls, ll, lo_):
        lo, hi = np.maximum(vs, s), np.minimum(vs + vl, s + n)
        hit = lo < hi
        pos_v, pos_l = vo[hit] + lo[hit] - vs[hit], o + lo[hit] - s
        pairs = (pos_l, pos_v) if swap else (pos_v, pos_l)
        out += list(zip(pairs[0].tolist(), pairs[1].tolist(), (hi[hit] - lo[hit]).tolist()))
    return out                            # both lists increase: so do the overlaps


def read_region(ckpt, index, name, box=None, flat=None):
    """One region of tensor `name`: a box [[start, stop], ...] or a flat range [start, stop].

    Only the pieces that overlap the region are read (the other files are not opened).
    A box asked of box pieces (tensor parallelism resumed from tensor parallelism) copies
    each overlapping piece's overlap with copy_overlap (exercise 11.2), reading the piece
    whole. Any other pair (a TP box out of ZeRO's flat ranges, a ZeRO range out of TP's
    boxes, ranges out of ranges) intersects the two as runs of the flattened tensor
    (flat_runs) and reads only the overlapping bytes of each file, one seek and read per
    run (format.read_ranges). READS counts the bytes needed and the bytes read."""
    t, shape, dtype = _tensor_entry(index, name)
    if (box is None) == (flat is None):
        raise ValueError("read_region takes exactly one of box= and flat=")
    if box is not None:
        box = [(int(a), int(b)) for a, b in box]
        if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
            raise CheckpointError(f"tensor {name!r}: box {box} lies outside its shape {shape}")
        out = np.empty([b - a for a, b in box], dtype)
        region = {"box": box}
    else:
        a, b = (int(v) for v in flat)
        total = int(np.prod(shape, dtype=np.int64))
        if not 0 <= a <= b <= total:
            raise CheckpointError(f"tensor {name!r}: flat range [{a}, {b}) lies outside its {total} elements")
        out = np.empty(b - a, dtype)
        region = {"flat": [a, b]}
    READS["needed"] += out.nbytes
    if not out.size:
        return out
    if box is not None and all("box" in p for p in t["pieces"]):
        copy = getattr(sys.modules[__name__], "copy_overlap")      # exercise 11.2, looked up now
        for p in t["pieces"]:
            if any(max(a, c) >= min(b, d) for (a, b), (c, d) in zip(box, p["box"])):
                continue                                   # no overlap: this file is not read
            copy(out, box, _read_piece(ckpt, index, p), p["box"])
        return out
    want, flat_out = flat_runs(region, shape), out.reshape(-1)
    first, last = int(want[0][0]), int(want[0][-1] + want[1][-1])
    for p in t["pieces"]:
        if "flat" in p and (p["flat"][1] <= first or p["flat"][0] >= last):
            continue                                       # outside the region's span: not read
        hits = overlap_runs(want, flat_runs(p, shape))
        if not hits:
            continue                                       # no overlap: this file is not read
        path = os.path.join(ckpt, p["file"])
        data, nbytes = read_ranges(path, p["key"], [(h, h + n) for _, h, n in hits],
                                   _checked_header(ckpt, index, p["file"]))
        READS["read"] += nbytes
        idx = np.concatenate([np.arange(w, w + n, dtype=np.int64) for w, _, n in hits])
        flat_out[idx] = data
    return out


def verify(path):
    """Every problem with the checkpoint `path` resolves to, one line each (empty: all is well).

    Reads every file in full (sizes, sha256), checks every piece's key, shape and dtype in
    its file, and the coverage of every tensor. Caches nothing."""
    try:
        ckpt = resolve(path)
        index = load_index(ckpt)
    except CheckpointError as e:
        return [str(e)]
    problems, headers = [], {}
    for fname, want in index["files"].items():
        file = os.path.join(ckpt, fname)
        if not os.path.isfile(file):
            problems.append(f"{file}: missing")
            continue
        size = os.path.getsize(file)
        if size != want["size"]:
            problems.append(f"{file}: {size} bytes, the index says {want['size']}: truncated, appended to or replaced")
        elif sha256_of(file) != want["sha256"]:
            problems.append(f"{file}: its sha256 differs from the index's: the file is corrupted")
        try:
            headers[fname] = read_header(file)
        except CheckpointError as e:
            problems.append(str(e))
    for name, t in index["tensors"].items():
        for p in t["pieces"]:
            header = headers.get(p["file"])
            if header is None:
                if p["file"] not in index["files"]:
                    problems.append(f"tensor {name!r}: a piece names {p['file']}, which the index does not list")
                continue
            e = header.get(p["key"])
            region = list(_region_shape(p, tuple(t["shape"])))
            if e is None:
                problems.append(f"{ckpt}/{p['file']}: holds no {p['key']!r} (a piece of {name!r})")
            elif e["shape"] != region or e["dtype"] != NAMES.get(t["dtype"]):
                problems.append(f"{ckpt}/{p['file']}: {p['key']!r} is {e['shape']} {e['dtype']}, "
                                f"the index expects {region} {t['dtype']}")
    try:
        problems += check_coverage(index)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        problems.append(f"{ckpt}/index.json: malformed piece ({type(e).__name__}: {e})")
    return problems

