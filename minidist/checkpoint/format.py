"""The safetensors file format, written by hand: the bytes every checkpoint file holds.

    from minidist.checkpoint.format import write_safetensors, read_safetensors

A safetensors file is three parts (https://github.com/huggingface/safetensors):

    8 bytes      N, the header's length, an unsigned little-endian integer
    N bytes      a JSON header, padded with spaces to a multiple of 8:
                 {"NAME": {"dtype": "F32", "shape": [4, 8], "data_offsets": [BEGIN, END]},
                  ..., "__metadata__": {"str": "str"}}
    the rest     the tensors' raw little-endian bytes, C order; BEGIN/END count from here

Why this format: loading it runs no code (a pickle, PyTorch's old format, runs whatever
the file says), a reader can fetch one tensor's bytes without reading the others (a rank
loading its shard of a big checkpoint needs exactly that), and PyTorch, JAX and the
Hugging Face tools read it. Why by hand: the format is the 40 lines below, and the
`safetensors` package would be one more dependency for them.

bfloat16 is NumPy's only through ml_dtypes, imported the first time a BF16 tensor is met
(importing it costs 0.6 s here). Every problem is a CheckpointError whose message names
the file and says what is wrong with it.
"""
import hashlib
import json
import os
import struct

import numpy as np

# safetensors' dtype codes and NumPy's names for them
CODES = {"F16": "float16", "F32": "float32", "F64": "float64", "BF16": "bfloat16",
         "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
         "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}
NAMES = {name: code for code, name in CODES.items()}
MAX_HEADER = 100 * 2**20          # the reference reader refuses headers over 100 MB too


class CheckpointError(Exception):
    """A checkpoint cannot be written or read; the message says which file and why."""


def dtype_from_name(name):
    """np.dtype for "float32", "bfloat16", ... (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes                      # late: 0.6 s to import, needed only for bf16
        return np.dtype(ml_dtypes.bfloat16)
    if name not in NAMES:
        raise CheckpointError(f"dtype {name!r} cannot be stored: safetensors holds "
                              f"{', '.join(sorted(NAMES))}")
    return np.dtype(name)


def _code(dtype, what):
    name = np.dtype(dtype).name
    if name not in NAMES:
        raise CheckpointError(f"{what}: dtype {name} cannot be stored in safetensors "
                              f"(it holds {', '.join(sorted(NAMES))})")
    return NAMES[name]


def _little_endian_bytes(a):
    """The array's bytes, C order, little-endian, as a flat uint8 view (no copy if possible)."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1).view(np.uint8)


def write_safetensors(path, tensors, metadata=None):
    """Write `tensors` ({name: array}) and `metadata` ({str: str}) to `path`, flush and fsync.

    Returns (size in bytes, sha256 hex digest) of what was written, computed on the way.
    """
    header, offset = {}, 0
    for name, a in tensors.items():
        a = np.asarray(a)
        nbytes = a.size * a.dtype.itemsize
        header[name] = {"dtype": _code(a.dtype, f"{path}: tensor {name!r}"),
                        "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise CheckpointError(f"{path}: __metadata__ holds strings only, {bad[0]!r} is not")
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                     # pad: the data starts 8-aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in [struct.pack("<Q", len(text)), text] + [_little_endian_bytes(a) for a in tensors.values()]:
            f.write(chunk)
            digest.update(chunk)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return size, digest.hexdigest()


class Header(dict):
    """The parsed JSON header ({name: entry, "__metadata__": ...}), plus where the data starts."""
    data_start = 0
    file_size = 0


def read_header(path):
    """The file's header, checked: every tensor's bytes lie inside the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file "
                                      "(8 bytes of header length come first): truncated?")
            (n,) = struct.unpack("<Q", first)
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: the header claims {n} bytes but the file has "
                                      f"{size}: truncated, or not a safetensors file")
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        parsed = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the header is not valid JSON ({e}): corrupted?") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    header = Header(parsed)
    header.data_start, header.file_size = 8 + n, size
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in e["data_offsets"])
            count = int(np.prod(e["shape"], dtype=np.int64))
            itemsize = 2 if e["dtype"] == "BF16" else np.dtype(CODES[e["dtype"]]).itemsize
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {e}") from None
        if not 0 <= begin <= end or end - begin != count * itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has offsets {[begin, end]} that do not "
                                  f"fit its shape {e['shape']} and dtype {e['dtype']}")
        if header.data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {header.data_start + end} "
                                  f"but the file has {size} bytes: truncated")
    return header


def _entry(path, name, header):
    """(header, tensor entry, begin, end, little-endian dtype) of tensor `name` in a file."""
    header = read_header(path) if header is None else header
    if name not in header or name == "__metadata__":
        raise CheckpointError(f"{path}: holds no tensor {name!r}")
    e = header[name]
    begin, end = e["data_offsets"]
    return header, e, begin, end, dtype_from_name(CODES[e["dtype"]]).newbyteorder("<")


def read_tensor(path, name, header=None):
    """One tensor, reading only its bytes (header: read_header(path), to skip reading it again)."""
    header, e, begin, end, dtype = _entry(path, name, header)
    buf = bytearray(end - begin)
    try:
        with open(path, "rb") as f:
            f.seek(header.data_start + begin)
            got = f.readinto(buf)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e.strerror or e})") from None
    if got != len(buf):
        raise CheckpointError(f"{path}: tensor {name!r} needs {len(buf)} bytes, the file had {got}: truncated")
    return np.frombuffer(buf, dtype).astype(dtype.newbyteorder("="), copy=False).reshape(e["shape"])


def read_ranges(path, name, ranges, header=None):
    """Elements of tensor `name` (flattened in C order) in `ranges`, [(start, stop), ...]
    in the order given, concatenated: one seek and one read per range (ranges that touch
    are read together), so only those bytes leave the file. Returns (1-D array, bytes read).
    A rank loading a box of a tensor that ZeRO saved as flat ranges reads this way."""
    header, e, begin, end, dtype = _entry(path, name, header)
    count = (end - begin) // dtype.itemsize
    merged = []
    for a, b in ranges:
        a, b = int(a), int(b)
        if not 0 <= a <= b <= count:
            raise CheckpointError(f"{path}: elements [{a}, {b}) lie outside tensor {name!r} ({count})")
        if b == a:
            continue
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    buf = bytearray(sum(b - a for a, b in merged) * dtype.itemsize)
    view, done = memoryview(buf), 0
    try:
        with open(path, "rb") as f:
            for a, b in merged:
                n = (b - a) * dtype.itemsize
                f.seek(header.data_start + begin + a * dtype.itemsize)
                if f.readinto(view[done:done + n]) != n:
                    raise CheckpointError(f"{path}: tensor {name!r} is cut short: truncated")
                done += n
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e.strerror or e})") from None
    return np.frombuffer(buf, dtype).astype(dtype.newbyteorder("="), copy=False), len(buf)


def read_safetensors(path):
    """Every tensor of the file, {name: array} (the metadata: read_header(path)["__metadata__"])."""
    header = read_header(path)
    return {name: read_tensor(path, name, header) for name in header if name != "__metadata__"}


def sha256_of(path):
    """The file's sha256 hex digest, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()
