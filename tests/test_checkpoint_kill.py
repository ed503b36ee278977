"""A rank of a real job killed with SIGKILL in the middle of a sharded save (mpirun -n 3,
ZeRO-1): the job ends, and the previous checkpoint is still what `latest` names, whole
and verified; the next save cleans up what the killed one left."""
import os
import subprocess
import sys

import pytest

from minidist.checkpoint import index as ckindex, read as reader

from launcher import mpirun_cmd, needs_mpirun

pytestmark = needs_mpirun

SAVE = """
import sys
from mpi4py import MPI
from minidist.checkpoint import layouts
from minidist.model import GPT, GPTConfig
from minidist.parallel.zero import ZeRO
comm = MPI.COMM_WORLD
cfg = GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=10, dtype="float64")
model = GPT(cfg, seed=int(sys.argv[2]))
zero = ZeRO(model, model.configure_optimizers(0.1, 1e-3), comm, 1)
layouts.save(comm, sys.argv[1], int(sys.argv[2]), model, zero, zero)
"""


def save(root, step, kill=None, rank=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", MINIDIST_TIMEOUT="20")
    if kill:
        env.update(MINIDIST_CKPT_KILL_AT=kill, MINIDIST_CKPT_KILL_RANK=str(rank))
    return subprocess.run([*mpirun_cmd(3), sys.executable, "-c", SAVE, str(root), str(step)],
                          capture_output=True, text=True, timeout=90, env=env)


@pytest.mark.parametrize("kill, rank", [("after-data", 1), ("after-rename", 0)])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, kill, rank):
    root = tmp_path / "ckpt"
    assert save(root, 1).returncode == 0
    before = {f: (root / "step00000001" / f).read_bytes() for f in os.listdir(root / "step00000001")}
    proc = save(root, 2, kill, rank)
    assert proc.returncode != 0, "the job should have ended with its killed rank"
    assert ckindex.resolve(str(root)).endswith("step00000001") and reader.verify(str(root)) == []
    assert {f: (root / "step00000001" / f).read_bytes() for f in before} == before
    assert save(root, 3).returncode == 0                       # the next save publishes and cleans up
    assert ckindex.resolve(str(root)).endswith("step00000003") and reader.verify(str(root)) == []
    assert not [f for f in os.listdir(root) if f.startswith(".tmp-")]
