"""Reading a checkpoint: a whole global tensor, a region of one, and every file checked.

    from minidist.checkpoint.read import resolve, load_index, read_global, read_region
    ckpt = resolve("ckpt"); index = load_index(ckpt)
    w = read_region(ckpt, index, "model.transformer.h.0.mlp.c_fc.weight", box=[[0, 64], [0, 32]])

Reading a region (read_region) opens only the files whose pieces overlap it, and from a
piece of another kind (a TP box out of ZeRO's flat ranges, or the reverse) reads only
the overlapping bytes: both regions become runs of the flattened tensor (flat_runs), the
runs are intersected (overlap_runs) and each overlap is one seek and read
(format.read_ranges). READS counts the bytes needed, read, and read for checksums.

Reading checks each file's size and sha256 against the index the first time this process
reads it (verdicts are cached), so a flipped byte, a truncated or a missing file is an
error that names the file. verify checks everything, caching nothing. The layout these
functions read (pieces, index.json) is described in index.py; store.py writes it.
"""
import os

import numpy as np

from minidist.checkpoint.format import (NAMES, CheckpointError, dtype_from_name, read_header,
                                        read_ranges, read_tensor, sha256_of)
from minidist.checkpoint.index import check_coverage, load_index, region_shape, resolve

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
        for p in t["pieces"]:
            if any(max(a, c) >= min(b, d) for (a, b), (c, d) in zip(box, p["box"])):
                continue                                   # no overlap: this file is not read
            copy_overlap(out, box, _read_piece(ckpt, index, p), p["box"])
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
            region = list(region_shape(p, tuple(t["shape"])))
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

