"""ZeRO-Infinity's disk tier (parallel/offload.py) against the same run in memory.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_offload.py

float64, the tiny GPT of test_zero.py, 3 AdamW steps with clipping, 2 micro-batches: with
offload="disk", stages 1-3 give the in-memory run's losses, weights and optimizer state
bit for bit, with the default chunk (larger than any piece) and with 64-byte chunks (8
elements: every piece is cut). The state lives in the files (their sizes are the
partition's bytes, their contents are the state); each step reads and writes m and v
once (and stage 3's shards); the files go when the ZeRO is closed.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from minidist.data import shard_slice
from minidist import equivalence
from minidist.parallel.fsdp import Units
from minidist.parallel.zero import ZeRO
from sharded_setup import ACCUM, BATCH, Setup

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 3
WHY = "the partitions (uneven at 3) are those of 3 and 4 ranks; each rank's files are its own, so more ranks show nothing new"

COMM = MPI.COMM_WORLD
N, RANK = COMM.Get_size(), COMM.Get_rank()
SETUP = Setup(n_layer=2)
CFG, DATA, ARGS, TC = SETUP.cfg, SETUP.data, SETUP.args, SETUP.tc


def folder(tmp_path_factory, name):
    """One folder for every rank (rank 0 names it): the file names tell the ranks apart."""
    path = str(tmp_path_factory.mktemp(name)) if RANK == 0 else None
    return COMM.bcast(path)


def run(stage, **kw):
    model, opt = SETUP.fresh()
    units = Units(model, COMM) if stage == 3 else None
    z = ZeRO(model, opt, COMM, stage, bucket_bytes=4096, units=units, **kw)
    rows = shard_slice(BATCH, RANK, N, ACCUM)
    reads = []
    step = z.step

    def counted_step():                          # the bytes each step moves, step by step
        before = z.offload_bytes()
        step()
        after = z.offload_bytes()
        reads.append((after["bytes_read"] - before["bytes_read"], after["bytes_written"] - before["bytes_written"]))
    z.step = counted_step
    losses, state, _ = equivalence.train_and_collect(model, z, DATA, ARGS, TC, rows, ACCUM, z)
    for g in z.groups:
        for name, q in zip(g.names_of_pieces, g.pieces):
            s = z.inner.state[id(q)]
            state[f"exp_avg:{name}"] = np.array(s["exp_avg"])
            state[f"exp_avg_sq:{name}"] = np.array(s["exp_avg_sq"])
            state[f"step:{name}"] = np.array(s["step"])
    return z, np.array(losses), state, reads


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bit_for_bit_files_bytes_and_close(stage, tmp_path_factory):
    _, ref_losses, ref_state, _ = run(stage)
    item = 8
    for chunk in (4 * 2**20, 64):
        where = folder(tmp_path_factory, f"stage{stage}-{chunk}")
        z, losses, state, moved = run(stage, offload="disk", offload_dir=where, chunk_bytes=chunk)
        assert np.array_equal(losses, ref_losses), f"stage {stage}, chunk {chunk}: losses {losses} != {ref_losses}"
        assert state.keys() == ref_state.keys()
        differ = [k for k in state if not np.array_equal(state[k], ref_state[k])]
        assert not differ, f"stage {stage}, chunk {chunk} B at {N} ranks: not bit for bit: {differ[:5]}"
        # the state lives in the files: views of the mappings, sizes the partition's bytes
        held = sum(g.hi - g.lo for g in z.groups)
        store = z.offload.store
        kinds = ["exp_avg", "exp_avg_sq"] + (["param"] if stage == 3 else [])
        names = sorted(os.listdir(where))
        assert [n for n in names if n.startswith(f"rank{RANK:05d}.")] == sorted(f"rank{RANK:05d}.{k}.f64" for k in kinds)
        assert store.file_bytes() == {k: item * held for k in kinds}
        for g in z.groups:
            for q in g.pieces:
                o = z.offload.offset[id(q)]
                for k in ("exp_avg", "exp_avg_sq"):
                    s = z.inner.state[id(q)][k]
                    assert np.shares_memory(s, store.maps[k]), f"{k} of a piece is not in its file"
                    on_disk = np.fromfile(store.paths[k], np.float64)[o:o + q.size]
                    assert np.array_equal(on_disk, s.reshape(-1)), f"{k}: the file does not hold the state"
                if stage == 3:
                    assert np.shares_memory(q.data, store.maps["param"]) and np.shares_memory(g.shard, store.maps["param"])
        # each step reads m and v (and the shards) once and writes them once
        per = (3 if stage == 3 else 2) * item * held
        assert moved == [(per, per)] * ARGS.steps, (moved, per)
        stats = z.offload_bytes()
        assert stats["steps"] == ARGS.steps and stats["bytes_read"] == ARGS.steps * per
        assert stats["bytes_written"] == ARGS.steps * per + (item * held if stage == 3 else 0)   # + the shards, once
        assert z.memory()["optimizer"] == 0 and z.memory()["disk"] == len(kinds) * item * held
        # closed: the files go (all ranks' files: every rank has closed once the barrier passes)
        with z:
            pass
        COMM.Barrier()
        assert os.listdir(where) == [], os.listdir(where)
        with pytest.raises(RuntimeError, match="removed"):
            z.step()


def test_existing_file_and_host_are_refused(tmp_path_factory):
    where = folder(tmp_path_factory, "refused")
    model, opt = SETUP.fresh()
    with ZeRO(model, opt, COMM, 1, offload="disk", offload_dir=where):
        model2, opt2 = SETUP.fresh()
        with pytest.raises(FileExistsError, match="close"):
            ZeRO(model2, opt2, COMM, 1, offload="disk", offload_dir=where)
    COMM.Barrier()
    assert os.listdir(where) == []
    with pytest.raises(ValueError, match="one memory"):
        ZeRO(model, opt, COMM, 1, offload="host")
    with pytest.raises(ValueError, match="offload must be"):
        ZeRO(model, opt, COMM, 1, offload="nvme")
