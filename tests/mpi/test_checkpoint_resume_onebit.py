"""Resuming a 1-bit run after its warm-up (minidist/checkpoint/layouts.py, float64): AdamW's
variance is frozen by then, and a checkpoint must say so and keep the step it was frozen
at (optim.v_step), or the resumed run is another run:

- 1-bit Adam (OneBitAdam): without them its next step has no v_step to read;
- 1-bit gradients with v frozen after the warm-up (lesson 10's default): without them
  AdamW would quietly go back to updating v.

5 steps in one go equal 3 steps (2 warm-up, 1 compressed), a save with the error-feedback
residuals, fresh objects (other weights), a load and 2 more steps: losses and weights bit
for bit.

    mpirun -n 2 python -m pytest -q --only-mpi tests/mpi/test_checkpoint_resume_onebit.py
"""
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from minidist.checkpoint import layouts
from minidist.data import Dataset, default_corpus
from minidist.model import GPT, GPTConfig
from minidist.parallel.compression import CompressedDataParallel, OneBitAdam
from minidist.train import micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 2
WHY = "the residuals and the frozen v are the same state at any size: 1 and 2 ranks show it"

COMM = MPI.COMM_WORLD
CFG = GPTConfig(block_size=8, vocab_size=256, n_layer=1, n_head=2, n_embd=8, dtype="float64")
DATA = Dataset.from_text(default_corpus()[:20_000], block_size=8, seed=5)
BATCH, LR, CLIP, WARMUP = 8, 3e-3, 1.0, 2


@pytest.fixture
def folder():
    raw = np.frombuffer((tempfile.mkdtemp(prefix="minidist-onebit-") if COMM.Get_rank() == 0
                         else "").encode(), np.uint8)
    n = np.array([len(raw)], np.int64)
    COMM.Bcast(n, root=0)                              # (buffer messages: no pickle)
    buf = raw.copy() if COMM.Get_rank() == 0 else np.empty(int(n[0]), np.uint8)
    COMM.Bcast(buf, root=0)
    name = buf.tobytes().decode()
    yield name
    COMM.Barrier()
    if COMM.Get_rank() == 0:
        shutil.rmtree(name, ignore_errors=True)


def fresh(variant, seed):
    model = GPT(CFG, seed=seed)
    inner = model.configure_optimizers(0.1, LR)
    dp = CompressedDataParallel(model, COMM, variant, warmup_steps=WARMUP)
    return model, OneBitAdam(inner, dp) if variant == "1bit-adam" else inner, dp


def steps(run, start, stop):
    """Steps [start, stop): each rank its rows; 1-bit gradients freeze v as lesson 10 does."""
    model, opt, dp = run
    per, rank = BATCH // COMM.Get_size(), COMM.Get_rank()
    losses = []
    for step in range(start, stop):
        x, y = DATA.get_batch("train", BATCH, step)
        rows = slice(rank * per, (rank + 1) * per)
        loss, _ = train_step(model, opt, micro_batches(x[rows], y[rows], step, 7, 1, rows.start),
                             LR, CLIP, dp=dp)
        losses.append(loss)
        if dp.compressor == "1bit" and step + 1 == WARMUP:
            opt.freeze_variance()
    return losses


@pytest.mark.parametrize("variant", ["1bit-adam", "1bit"])
def test_a_resume_after_the_warm_up_keeps_v_frozen(folder, variant):
    straight = fresh(variant, 11)
    want = steps(straight, 0, 5)
    a = fresh(variant, 11)
    first = steps(a, 0, 3)
    assert a[1].variance_frozen
    per_rank = {f"compression.{k}": v for k, v in a[2].state_dict().items()}
    layouts.save(COMM, folder, 3, a[0], a[1], state={"per_rank": per_rank})
    b = fresh(variant, 99)                                  # other weights: the load replaces them
    layouts.load(COMM, folder, b[0], b[1])
    _, mine, dropped = layouts.read_state(COMM, folder)
    assert not dropped
    b[2].load_state_dict({k[12:]: v for k, v in mine.items()})
    assert b[1].variance_frozen
    rest = steps(b, 3, 5)
    assert first + rest == want                             # float64, bit for bit
    for p, q in zip(straight[0].parameters(), b[0].parameters()):
        assert np.array_equal(p.data, q.data)
