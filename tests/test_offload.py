"""parallel/offload.py in one process: rss_bytes, the pages that leave the resident set,
and float32 steps bit for bit (the float64 runs at 1-4 ranks: tests/mpi/test_offload.py)."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from minidist.model import GPT, GPTConfig
from minidist.parallel import offload
from minidist.parallel.fsdp import Units
from minidist.parallel.zero import ZeRO
from minidist.train import train_step

MIB = 2**20
LINUX = os.path.exists("/proc/self/status")


def test_rss_bytes_is_positive_and_grows_when_an_array_is_touched():
    before = offload.rss_bytes()
    assert before > 0
    a = np.ones(48 * MIB // 8)                       # 48 MiB, every page written
    grown = offload.rss_bytes() - before
    assert grown > 32 * MIB, f"rss grew {grown / MIB:.1f} MiB for a 48 MiB array"
    del a
    assert offload.peak_rss_bytes() >= before + 32 * MIB


@pytest.mark.skipif(not LINUX, reason="VmRSS and madvise: Linux")
def test_dropped_pages_leave_the_resident_set(tmp_path):
    store = offload.DiskStore(tmp_path, 0, chunk_bytes=MIB)
    n = 32 * MIB // 8
    mm = store.create("exp_avg", n, np.float64)
    before = offload.rss_bytes()
    mm[:] = 1.0                                      # every page mapped and dirty
    assert offload.rss_bytes() - before > 24 * MIB
    store.drop("exp_avg")
    assert offload.rss_bytes() - before < 4 * MIB, "the file's pages are still resident"
    assert mm[n - 1] == 1.0 and mm.sum() == n       # the data stayed (in the page cache and the file)
    store.close()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("stage", [1, 3])
def test_float32_steps_are_bit_for_bit(stage, tmp_path):
    cfg = GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=8, dtype="float32")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (4, 8))
    y = rng.integers(0, 64, (4, 8))
    out = []
    for kw in ({}, dict(offload="disk", offload_dir=str(tmp_path), chunk_bytes=20)):
        model = GPT(cfg, seed=3)
        opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
        units = Units(model, MPI.COMM_SELF) if stage == 3 else None
        with ZeRO(model, opt, MPI.COMM_SELF, stage, units=units, **kw) as z:
            for _ in range(2):
                train_step(model, z, [(x, y, None)], 1e-2, grad_clip=0.1, dp=z)
            out.append([np.array(q.data) for g in z.groups for q in g.pieces] +
                       [np.array(z.inner.state[id(q)][k]) for g in z.groups for q in g.pieces
                        for k in ("exp_avg", "exp_avg_sq")])
    assert out[0][0].dtype == np.float32
    assert all(np.array_equal(a, b) for a, b in zip(*out))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("stage, clip", [(2, 0.0), (3, 0.1)])
def test_gradients_in_a_file_and_a_prefetching_reader_keep_the_bits(stage, clip, tmp_path):
    """ZeRO-Offload's gradients (offload_grads: the reduced partition goes to a file as it
    arrives) and the reader thread that fetches the next chunk during this one's step:
    in turn or prefetched, the same bits as in memory; the reads run on the reader thread,
    and each step reads the gradients from the file (clipped ones are written there first)."""
    import threading
    cfg = GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=8, dtype="float64")
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 64, (4, 8)), rng.integers(0, 64, (4, 8))
    out, threads = [], set()
    for kw, prefetch in (({}, None), (dict(offload="disk", offload_dir=str(tmp_path), chunk_bytes=40), False),
                         (dict(offload="disk", offload_dir=str(tmp_path), chunk_bytes=40), True)):
        model = GPT(cfg, seed=5)
        opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
        units = Units(model, MPI.COMM_SELF) if stage == 3 else None
        with ZeRO(model, opt, MPI.COMM_SELF, stage, units=units, **kw) as z:
            if kw:
                z.offload.offload_grads()
                z.offload.prefetch = prefetch
                read = z.offload.store.read
                z.offload.store.read = lambda *a: threads.add((prefetch, threading.get_ident())) or read(*a)
            for _ in range(2):
                train_step(model, z, [(x, y, None)], 1e-2, grad_clip=clip, dp=z)
                if kw:
                    store = z.offload.store
                    assert all(np.shares_memory(q.grad, store.maps["grad"]) for g in z.groups for q in g.pieces)
            if kw:
                held = sum(g.hi - g.lo for g in z.groups)
                assert store.stats["read_by_kind"]["grad"] == 2 * 8 * held, store.stats
            out.append([np.array(q.data) for g in z.groups for q in g.pieces] +
                       [np.array(z.inner.state[id(q)][k]) for g in z.groups for q in g.pieces
                        for k in ("exp_avg", "exp_avg_sq")])
    assert all(np.array_equal(a, b) for a, b in zip(out[0], out[1]))
    assert all(np.array_equal(a, b) for a, b in zip(out[0], out[2]))
    main = threading.get_ident()
    assert {t for p, t in threads if p is False} == {main}
    assert main not in {t for p, t in threads if p is True}, "prefetch: the reads should run on the reader"
    assert not os.listdir(tmp_path)
