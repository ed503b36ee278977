"""Sharded checkpoints that survive a kill: every rank writes its pieces, rank 0 publishes.

    from minidist.checkpoint.store import save
    from minidist.checkpoint.read import resolve, load_index, read_global, verify
    path = save(comm, "ckpt", step, pieces, meta, keep=3)      # on every rank
    index = load_index("ckpt"); w = read_global(resolve("ckpt"), index, "model.transformer.wte.weight")

This file is the save and its commit protocol. What a checkpoint is on disk (pieces,
boxes, flat ranges, index.json, `latest`) is in index.py; the readers (read_global,
read_region, verify) are in read.py: import them from there.

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
"""
import json
import os
import secrets
import shutil
import signal

import numpy as np

from minidist.checkpoint.format import CheckpointError, write_safetensors
from minidist.checkpoint.index import (FORMAT, STEP_DIR, VERSION, check_coverage, check_piece,
                                       region_shape, step_dir)

KILL_STAGES = ("after-data", "after-index", "after-rename", "after-latest")


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


def agree(comm, error):
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
        problems = check_piece(p, f"piece {i}")
        if problems:
            raise CheckpointError(problems[0])
        name, shape = p["name"], tuple(int(n) for n in p["global_shape"])
        dtype, a = np.dtype(p["dtype"]), np.asarray(p["array"])
        want = region_shape(p, shape)
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
    agree(comm, error)
    if comm is not None:
        with _waiting("checkpoint save: the folder's name"):
            comm.Bcast(token, root=0)
    tmp = token.tobytes().rstrip(b"\0").decode()
    folder = os.path.join(root, tmp)
    try:
        fragment, error = _attempt(_write_rank, folder, rank, pieces)
        _kill_point("after-data", rank)
        agree(comm, error)
        fragments = _gather_fragments(comm, fragment)
        path, error = (_attempt(_publish, root, tmp, int(step), meta, fragments, keep, require) if rank == 0
                       else (None, None))
        agree(comm, error)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)     # nothing published: leave no trace
        raise
    return os.path.join(root, step_dir(int(step)))

