"""Sharded checkpoints across ranks: saved under one split, read back under another.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_checkpoint_store.py

Every rank builds the global tensors from one seed, so each can check what it reads
without communication. The save splits them as tensor parallelism and ZeRO would (boxes
of columns, uneven flat ranges, the last rank holding nothing when there are several);
the reads ask for rows and other flat ranges, as a rank under another layout does.
An error on one rank (a gap in coverage, a failed write) must reach every rank as the
same CheckpointError, with nothing published.
"""
import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from minidist.checkpoint import index as ckindex, read as reader, store
from minidist.checkpoint.format import CheckpointError

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "splits of 1-4 ranks already hold every case: empty pieces, uneven flat ranges, regions across pieces"

COMM = MPI.COMM_WORLD
N, RANK = COMM.Get_size(), COMM.Get_rank()
RNG = np.random.default_rng(21)
GLOBAL = {"w": RNG.standard_normal((5, 9)), "v": RNG.standard_normal(13).astype(np.float32),
          "n": np.array(4, np.int64)}


@pytest.fixture
def root():
    """One fresh folder, the same on every rank (rank 0 makes it, broadcasts its name)."""
    name = np.zeros(256, np.uint8)
    if RANK == 0:
        path = tempfile.mkdtemp(prefix="minidist-ckpt-").encode()
        name[:len(path)] = np.frombuffer(path, np.uint8)
    COMM.Bcast(name, root=0)
    path = name.tobytes().rstrip(b"\0").decode()
    yield path
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def bounds(n, parts, r):
    """np.array_split's chunk r of range(n)."""
    edges = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), parts)])
    return int(edges[r]), int(edges[r + 1])


def my_pieces(step=0):
    """w in column boxes over the writers, v in flat ranges over all ranks, n on rank 0."""
    writers = max(N - 1, 1)                        # the last rank writes no w (when N > 1)
    out = []
    if RANK < writers:
        a, b = bounds(9, writers, RANK)
        out.append(dict(name="w", global_shape=(5, 9), dtype=np.dtype(np.float64), box=[[0, 5], [a, b]],
                        array=GLOBAL["w"][:, a:b] + step))
    a, b = bounds(13, N, RANK)
    out.append(dict(name="v", global_shape=(13,), dtype=np.dtype(np.float32), flat=[a, b],
                    array=GLOBAL["v"][a:b] + step))
    if RANK == 0:
        out.append(dict(name="n", global_shape=(), dtype=np.dtype(np.int64), box=[], array=GLOBAL["n"] + step))
    return out


def same_everywhere(text):
    """Every rank holds the same text (compared by crc32, one Allgather)."""
    mine = np.array([zlib.crc32(text.encode())], np.int64)
    every = np.empty(N, np.int64)
    COMM.Allgather(mine, every)
    return bool(np.all(every == every[0]))


def test_saved_in_one_split_read_in_another(root):
    path = store.save(COMM, root, 1, my_pieces(), {"layout": {"kind": "test", "ranks": N}})
    assert path == os.path.join(root, "step00000001")
    index = ckindex.load_index(root)
    assert index["world_size"] == N and len(index["files"]) == N
    assert [len(index["tensors"][k]["pieces"]) for k in ("w", "v", "n")] == [max(N - 1, 1), N, 1]
    ckpt = ckindex.resolve(root)
    a, b = bounds(5, N, RANK)                       # rows, where the save split columns
    assert np.array_equal(reader.read_region(ckpt, index, "w", box=[[a, b], [0, 9]]), GLOBAL["w"][a:b])
    a, b = bounds(13, N + 1, (RANK + 1) % (N + 1))   # other flat ranges than the save's
    assert np.array_equal(reader.read_region(ckpt, index, "v", flat=[a, b]), GLOBAL["v"][a:b])
    a, b = bounds(45, N, RANK)                       # a ZeRO partition of the boxed w
    assert np.array_equal(reader.read_region(ckpt, index, "w", flat=[a, b]), GLOBAL["w"].reshape(-1)[a:b])
    assert np.array_equal(reader.read_global(ckpt, index, "v"), GLOBAL["v"])
    assert reader.read_global(ckpt, index, "n") == 4
    if RANK == 0:
        assert reader.verify(root) == []


def test_a_gap_on_one_rank_is_the_same_error_on_every_rank(root):
    pieces = my_pieces()
    if RANK == N - 1:                               # the last rank's v range loses its last element
        p = pieces[-1] if N > 1 else pieces[1]
        p["flat"], p["array"] = [p["flat"][0], p["flat"][1] - 1], p["array"][:-1]
    with pytest.raises(CheckpointError, match="tensor 'v': 1 of 13 elements not covered") as e:
        store.save(COMM, root, 1, pieces, {})
    assert same_everywhere(str(e.value)), f"rank {RANK} raised a different error: {e.value}"
    COMM.Barrier()
    assert os.listdir(root) == [], "a failed save left something behind"


def test_a_failed_write_on_one_rank_is_the_same_error_on_every_rank(root, monkeypatch):
    if RANK == N - 1:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(store, "write_safetensors", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        store.save(COMM, root, 1, my_pieces(), {})
    assert (f"rank {N - 1}: " in str(e.value)) == (N > 1), str(e.value)
    assert same_everywhere(str(e.value))
    COMM.Barrier()
    assert os.listdir(root) == [], "a failed save left something behind"


def test_keep_and_latest_across_ranks(root):
    for step in (1, 2, 3):
        store.save(COMM, root, step, my_pieces(step), {}, keep=2)
    COMM.Barrier()
    assert sorted(os.listdir(root)) == ["latest", "step00000002", "step00000003"]
    index = ckindex.load_index(root)
    assert index["step"] == 3
    assert np.array_equal(reader.read_global(ckindex.resolve(root), index, "w"), GLOBAL["w"] + 3)
    with pytest.raises(CheckpointError, match="already exists") as e:
        store.save(COMM, root, 3, my_pieces(3), {})
    assert same_everywhere(str(e.value))
