"""Text in, batches out: a byte-level tokenizer, the default corpus, deterministic batches,
and the cut of a global batch into per-rank shards.

The tokenizer is the simplest there is: a token is a byte (vocab 256), so any UTF-8 text
trains without a vocabulary file and decode(encode(s)) == s for every string.

The default corpus is on every machine that has Python: the source of a few packages of
the Python standard library, read in a fixed order. Nothing is downloaded. A GPT trained
on it learns to write something that looks like Python. `--data PATH` takes any UTF-8 file.
"""
import os
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
# standard-library packages whose source makes the default corpus (about 1 MB)
CORPUS_PACKAGES = ("json", "email", "http", "logging", "unittest", "importlib")
CORPUS_MAX_BYTES = 1 << 20


class DataError(ValueError):
    """A data file that cannot be used: missing, empty or not text."""


def encode(text):
    """str -> uint8 token ids (its UTF-8 bytes)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(ids):
    """token ids -> str; a byte sequence cut mid-character shows as U+FFFD."""
    return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def default_corpus():
    """The source of a few standard-library packages, in sorted order, up to ~1 MB."""
    stdlib = Path(os.__file__).parent
    parts, size = [], 0
    for pkg in CORPUS_PACKAGES:
        for f in sorted((stdlib / pkg).rglob("*.py")):
            text = f.read_text(encoding="utf-8", errors="replace")
            parts.append(text)
            size += len(text)
            if size >= CORPUS_MAX_BYTES:
                return "".join(parts)
    if size == 0:
        raise DataError(f"the default corpus was not found under {stdlib}; pass --data PATH")
    return "".join(parts)


def load_text(path=None):
    """The text of `path` (UTF-8), or the default corpus when path is None."""
    if path is None:
        return default_corpus()
    p = Path(path)
    if not p.exists():
        raise DataError(f"--data {path}: no such file")
    if not p.is_file():
        raise DataError(f"--data {path}: not a regular file")
    raw = p.read_bytes()
    if not raw.strip():
        raise DataError(f"--data {path}: the file is empty")
    if b"\0" in raw:
        raise DataError(f"--data {path}: not a text file (it contains NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {path}: not UTF-8 text (bad byte at offset {e.start})")


class Dataset:
    """Tokens split into train (first 90%) and val (last 10%), cut into random windows.

    get_batch(split, batch_size, step) is a pure function of (seed, split, step): any
    process asking for step 7 gets the same batch, which is how a parallel run and the
    single-process reference see the same global batch.
    """

    def __init__(self, tokens, block_size, seed=1337, val_fraction=0.1):
        tokens = np.asarray(tokens, dtype=np.int64)
        n_val = int(len(tokens) * val_fraction)
        self.splits = {"train": tokens[:len(tokens) - n_val], "val": tokens[len(tokens) - n_val:]}
        self.block_size = block_size
        self.seed = seed
        for name, t in self.splits.items():
            if len(t) < block_size + 2:
                raise DataError(f"the {name} split has {len(t)} tokens, too few for block_size "
                                f"{block_size}: use a longer text or a smaller --block-size")

    @classmethod
    def from_text(cls, text, block_size, seed=1337):
        return cls(encode(text), block_size, seed)

    def get_batch(self, split, batch_size, step):
        """(x, y), each int64 (batch_size, block_size); y is x shifted one token left."""
        data = self.splits[split]
        rng = np.random.default_rng([self.seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(data) - self.block_size - 1, size=batch_size)
        offsets = starts[:, None] + np.arange(self.block_size)  # (B, T)
        return data[offsets], data[offsets + 1]


def shard_slice(global_batch, rank, world, micro_batches=1):
    """The rows of a global batch that `rank` of `world` owns: a contiguous block.

    Ranks take equal blocks in rank order, so sample i of the global batch always lives
    on rank i // (global_batch // world); each block must then split into
    `micro_batches` equal micro-batches. Anything else is a ValueError in plain words.
    """
    per_rank, rest = divmod(global_batch, world)
    if rest or per_rank == 0:
        raise ValueError(f"the global batch of {global_batch} samples does not divide evenly "
                         f"among {world} data-parallel ranks; choose a multiple of {world}")
    if per_rank % micro_batches:
        raise ValueError(f"each rank's {per_rank} samples do not split into {micro_batches} equal "
                         f"micro-batches; choose a global batch that is a multiple of "
                         f"{world * micro_batches} (ranks x accumulation steps)")
    return slice(rank * per_rank, (rank + 1) * per_rank)
