"""Checkpoints of real runs (minidist/checkpoint/layouts.py over store.py), float64:

- resume exact: 6 steps in one go equal 3 steps, a save, fresh objects (other weights),
  a load and 3 more steps: losses and weights bit for bit, under data parallelism and
  ZeRO 1, 2 and 3 on the job's ranks;
- reshard: a checkpoint saved by ZeRO-3 loads into one process, data parallelism, ZeRO-1,
  and FSDP on one rank fewer (an odd size at 4): the loaded weights and AdamW state equal
  the saved ones bit for bit, and 3 more steps give the losses of the uninterrupted run.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_checkpoint_resume.py
"""
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from minidist.checkpoint import index as ckindex, layouts, read as reader
from minidist.data import Dataset, default_corpus
from minidist.model import GPT, GPTConfig
from minidist.parallel import fsdp
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.zero import ZeRO
from minidist.train import micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "the layouts' pieces are those of 1-3 ranks (uneven partitions at 3); TP 2 x PP 2 needs 4; 8 adds no case"


def below_4():
    """At 4 ranks only the TP 2 x PP 2 cases run: the others showed all they check at 1-3."""
    if COMM.Get_size() > 3:
        pytest.skip("runs at 1-3 ranks; 4 ranks add no case (TP 2 x PP 2 runs there)")

COMM = MPI.COMM_WORLD
CFG = GPTConfig(block_size=9, vocab_size=256, n_layer=1, n_head=2, n_embd=10, dtype="float64")
DATA = Dataset.from_text(default_corpus()[:20_000], block_size=9, seed=5)
BATCH, LR, CLIP = 24, 3e-3, 0.05


def shared_folder():
    """One temporary folder for the whole job (rank 0 makes it, every rank learns its name)."""
    name = tempfile.mkdtemp(prefix="minidist-ckpt-") if COMM.Get_rank() == 0 else ""
    raw = np.frombuffer(name.encode(), np.uint8)
    n = np.array([len(raw)], np.int64)
    COMM.Bcast(n, root=0)
    buf = raw.copy() if COMM.Get_rank() == 0 else np.empty(int(n[0]), np.uint8)
    COMM.Bcast(buf, root=0)
    return buf.tobytes().decode()


@pytest.fixture
def folder():
    path = shared_folder()
    yield path
    COMM.Barrier()
    if COMM.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def build(kind, comm, seed=11):
    """(model, optimizer, dp slot, zero or None) for a layout on `comm`."""
    model = GPT(CFG, seed=seed)
    opt = model.configure_optimizers(0.1, LR)
    if kind == "dp":
        return model, opt, NaiveDataParallel(model, comm), None
    stage = int(kind[-1])
    zero = (fsdp.FSDP(model, opt, comm) if stage == 3 else ZeRO(model, opt, comm, stage))
    return model, zero, zero, zero


def train(model, opt, dp, comm, start, stop):
    """Steps [start, stop): each rank its rows of the global batch; the mean loss per step."""
    size, rank = comm.Get_size(), comm.Get_rank()
    per = BATCH // size
    losses = []
    for step in range(start, stop):
        x, y = DATA.get_batch("train", BATCH, step)
        rows = slice(rank * per, (rank + 1) * per)
        loss, _ = train_step(model, opt, micro_batches(x[rows], y[rows], step, 7, 1, rows.start), LR, CLIP, dp=dp)
        total = np.empty(1)
        comm.Allreduce(np.array([loss]), total, op=MPI.SUM)
        losses.append(float(total[0]) / size)
    return losses


def global_weights(path):
    ckpt = ckindex.resolve(path)
    index = ckindex.load_index(ckpt)
    names = [n for n in index["tensors"] if n.startswith(("model.", "optim."))]
    return {n: reader.read_global(ckpt, index, n) for n in names}


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero2", "zero3"])
def test_resume_is_bit_for_bit(folder, kind):
    below_4()
    model, opt, dp, zero = build(kind, COMM)
    straight = train(model, opt, dp, COMM, 0, 6)
    layouts.save(COMM, os.path.join(folder, "straight"), 6, model, opt, zero)

    model, opt, dp, zero = build(kind, COMM)
    first = train(model, opt, dp, COMM, 0, 3)
    layouts.save(COMM, os.path.join(folder, "run"), 3, model, opt, zero)
    model, opt, dp, zero = build(kind, COMM, seed=99)          # other weights: the load must replace them
    meta = layouts.load(COMM, os.path.join(folder, "run"), model, opt, zero)
    assert meta["train_step"] == 3 and meta["optimizer_step"] == 3
    rest = train(model, opt, dp, COMM, 3, 6)
    layouts.save(COMM, os.path.join(folder, "resumed"), 6, model, opt, zero)
    assert first + rest == straight                            # float64, bit for bit
    a, b = global_weights(os.path.join(folder, "straight")), global_weights(os.path.join(folder, "resumed"))
    assert set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(np.asarray(b))), 1e-300))


@pytest.mark.parametrize("target", ["single", "dp", "zero1", "fsdp-fewer"])
def test_a_zero3_checkpoint_loads_under_another_layout(folder, target):
    below_4()
    reference = train(*build("dp", MPI.COMM_SELF)[:3], MPI.COMM_SELF, 0, 6)   # one process, 6 steps
    model, opt, dp, zero = build("zero3", COMM)
    train(model, opt, dp, COMM, 0, 3)
    path = os.path.join(folder, "z3")
    layouts.save(COMM, path, 3, model, opt, zero)
    saved = global_weights(path)

    size = {"single": 1, "fsdp-fewer": max(1, COMM.Get_size() - 1)}.get(target, COMM.Get_size())
    sub = COMM.Split(0 if COMM.Get_rank() < size else MPI.UNDEFINED, COMM.Get_rank())
    if sub != MPI.COMM_NULL:
        kind = {"single": "dp", "dp": "dp", "zero1": "zero1", "fsdp-fewer": "zero3"}[target]
        model, opt, dp, zero = build(kind, sub, seed=99)
        layouts.load(sub, path, model, opt, zero)
        if zero is None:                                       # whole tensors: equal bit for bit
            state = {id(p): s for p, s in ((p, opt.state.get(id(p))) for p in model.parameters())}
            for name, p in model.named_parameters():
                assert np.array_equal(p.data, saved[f"model.{name}"]), name
                assert np.array_equal(state[id(p)]["exp_avg"], saved[f"optim.exp_avg.{name}"]), name
                assert np.array_equal(state[id(p)]["exp_avg_sq"], saved[f"optim.exp_avg_sq.{name}"]), name
        else:                                                  # my partition of each: equal bit for bit
            for g in zero.groups:
                for q, _, name, a, b in g.spans():
                    assert np.array_equal(q.data.reshape(-1), saved[f"model.{name}"].reshape(-1)[a:b]), name
                    s = zero.inner.state[id(q)]
                    assert np.array_equal(s["exp_avg"].reshape(-1), saved[f"optim.exp_avg.{name}"].reshape(-1)[a:b])
        rest = train(model, opt, dp, sub, 3, 6)
        assert max(_rel(a, b) for a, b in zip(rest, reference[3:])) <= 1e-10, (rest, reference[3:])
        sub.Free()
    COMM.Barrier()


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(folder):
    below_4()
    model, opt, dp, zero = build("dp", COMM)
    train(model, opt, dp, COMM, 0, 1)
    layouts.save(COMM, folder, 1, model, opt, zero)
    other = GPT(GPTConfig(block_size=9, vocab_size=256, n_layer=1, n_head=2, n_embd=12, dtype="float64"))
    from minidist.checkpoint.format import CheckpointError
    with pytest.raises(CheckpointError, match="transformer"):
        layouts.load(COMM, folder, other, other.configure_optimizers(0.1, LR))


# ----------------------------------------------------------------------------- tensor and pipeline parallelism

TP_CFG = GPTConfig(block_size=9, vocab_size=255, n_layer=2, n_head=2, n_embd=10, dtype="float64")   # 255: padded


def build_tp(comm, seed=11):
    from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync
    model = TensorParallelGPT(GPT(TP_CFG, seed=seed), comm)
    return model, model.configure_optimizers(0.1, LR), TensorParallelSync(model), None


def build_3d(seed=11):
    from minidist.comm import ProcessGrid
    from minidist.parallel.parallel_3d import Parallel3D, build_stage
    grid = ProcessGrid(tp=2, pp=2, dp=1)
    stage, tp_model = build_stage(GPT(TP_CFG, seed=seed), grid)
    opt = stage.configure_optimizers(0.1, LR) if hasattr(stage, "configure_optimizers") else \
        GPT.configure_optimizers(stage, 0.1, LR)
    return stage, opt, Parallel3D(stage, tp_model, grid, "1f1b", 2, opt), None


def train_whole_batch(model, opt, dp, start, stop, m=1):
    """Steps [start, stop) on the whole batch (tensor parallelism and the pipeline see it all)."""
    losses = []
    for step in range(start, stop):
        x, y = DATA.get_batch("train", BATCH, step)
        loss, _ = train_step(model, opt, micro_batches(x, y, step, 7, m), LR, CLIP, dp=dp)
        losses.append(loss)
    return losses


def _sub(n):
    return COMM.Split(0 if COMM.Get_rank() < n else MPI.UNDEFINED, COMM.Get_rank())


def test_resume_is_bit_for_bit_under_a_pipeline(folder):
    """A pipeline of N stages (every rank one stage; the tied embedding on the first and
    the last): 6 steps equal 3, a save, a load into other weights and 3 more."""
    below_4()
    from minidist.lessons import layout_runs
    cfg = GPTConfig(block_size=9, vocab_size=256, n_layer=COMM.Get_size(), n_head=2, n_embd=10, dtype="float64")
    runs = []
    for seed, stops in ((11, [(0, 6)]), (11, [(0, 3)]), (99, [(3, 6)])):
        run = layout_runs.build("pp", COMM, cfg, seed, LR)
        if seed == 99:
            layouts.load(COMM, os.path.join(folder, "run"), run.model, run.opt)
        losses = [x for a, b in stops for x in layout_runs.train(run, DATA, BATCH, a, b, LR, CLIP, 7)]
        runs.append(losses)
        name = {0: "straight", 1: "run", 2: "resumed"}[len(runs) - 1]
        layouts.save(COMM, os.path.join(folder, name), 6 if name != "run" else 3, run.model, run.opt)
    assert runs[1] + runs[2] == runs[0]
    a, b = global_weights(os.path.join(folder, "straight")), global_weights(os.path.join(folder, "resumed"))
    assert set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind", ["tp2", "tp2-pp2"])
def test_resume_is_bit_for_bit_under_tensor_and_pipeline_parallelism(folder, kind):
    need = 2 if kind == "tp2" else 4
    if COMM.Get_size() < need or (kind == "tp2-pp2" and COMM.Get_size() != 4):
        pytest.skip(f"{kind} runs on {need} ranks")
    sub = _sub(need) if kind == "tp2" else COMM
    if sub != MPI.COMM_NULL:
        build = (lambda seed=11: build_tp(sub, seed)) if kind == "tp2" else build_3d
        m = 1 if kind == "tp2" else 2
        model, opt, dp, _ = build()
        straight = train_whole_batch(model, dp if kind != "tp2" else opt, dp, 0, 6, m)
        layouts.save(sub, os.path.join(folder, "straight"), 6, model, opt)
        model, opt, dp, _ = build()
        first = train_whole_batch(model, dp if kind != "tp2" else opt, dp, 0, 3, m)
        layouts.save(sub, os.path.join(folder, "run"), 3, model, opt)
        model, opt, dp, _ = build(seed=99)
        layouts.load(sub, os.path.join(folder, "run"), model, opt)
        rest = train_whole_batch(model, dp if kind != "tp2" else opt, dp, 3, 6, m)
        layouts.save(sub, os.path.join(folder, "resumed"), 6, model, opt)
        assert first + rest == straight
        if sub.Get_rank() == 0:
            a, b = global_weights(os.path.join(folder, "straight")), global_weights(os.path.join(folder, "resumed"))
            assert set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)
            assert a["model.transformer.wte.weight"].shape == (255, 10)      # the padding is not saved
        if sub is not COMM:
            sub.Free()
    COMM.Barrier()


def test_tp_pp_checkpoint_loads_into_one_process_and_zero3_into_tp_pp(folder):
    if COMM.Get_size() != 4:
        pytest.skip("TP 2 x PP 2 runs on 4 ranks")
    ref_model = GPT(TP_CFG, seed=11)
    ref_opt = ref_model.configure_optimizers(0.1, LR)
    reference = train_whole_batch(ref_model, ref_opt, None, 0, 6)
    # TP 2 x PP 2 for 3 steps, saved; one process (rank 0) goes on from it
    model, opt, dp, _ = build_3d()
    train_whole_batch(model, dp, dp, 0, 3, 2)
    layouts.save(COMM, os.path.join(folder, "3d"), 3, model, opt)
    if COMM.Get_rank() == 0:
        one = GPT(TP_CFG, seed=99)
        one_opt = one.configure_optimizers(0.1, LR)
        layouts.load(MPI.COMM_SELF, os.path.join(folder, "3d"), one, one_opt)
        rest = train_whole_batch(one, one_opt, None, 3, 6)
        assert max(_rel(a, b) for a, b in zip(rest, reference[3:])) <= 1e-10
    # ZeRO-3 on 4 ranks for 3 steps, saved; TP 2 x PP 2 goes on from it to the reference's weights
    zmodel = GPT(TP_CFG, seed=11)
    zero = fsdp.FSDP(zmodel, zmodel.configure_optimizers(0.1, LR), COMM)
    train(zmodel, zero, zero, COMM, 0, 3)
    layouts.save(COMM, os.path.join(folder, "z3"), 3, zmodel, zero, zero)
    model, opt, dp, _ = build_3d(seed=99)
    layouts.load(COMM, os.path.join(folder, "z3"), model, opt)
    train_whole_batch(model, dp, dp, 3, 6, 2)
    layouts.save(COMM, os.path.join(folder, "3d-from-z3"), 6, model, opt)
    got = global_weights(os.path.join(folder, "3d-from-z3"))
    for name, p in ref_model.named_parameters():
        assert _rel(got[f"model.{name}"], p.data) <= 1e-10, name


# ----------------------------------------------------------------------------- lesson 10's state

def test_resume_keeps_the_loss_scale_the_residuals_and_the_curriculum(folder):
    """fp16 with fp32 masters and a loss scale that moves, 1-bit compression with error
    feedback, a sequence-length curriculum: all three are state a resumed run needs."""
    below_4()
    from minidist.curriculum import Curriculum
    from minidist.parallel.compression import CompressedDataParallel
    from minidist.precision import GradScaler, MixedPrecision, autocast
    cfg = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=12, dtype="float32")
    data = Dataset.from_text(default_corpus()[:20_000], block_size=16, seed=5)

    def fresh(seed):
        model = GPT(cfg, seed=seed)
        opt = MixedPrecision(model.configure_optimizers(0.1, LR), model, "fp16")
        return (model, opt, CompressedDataParallel(model, COMM, "1bit", warmup_steps=1),
                GradScaler(init_scale=2.0 ** 12, growth_interval=2, comm=COMM),
                Curriculum(16, BATCH, total_tokens=10 ** 9, ramp_steps=5, start=8))

    def steps(run, n):
        model, opt, dp, scaler, cur = run
        per, rank = BATCH // COMM.Get_size(), COMM.Get_rank()
        losses = []
        for _ in range(n):
            L = cur.seqlen()
            x, y = data.get_batch("train", BATCH, cur.step)
            rows = slice(rank * per, (rank + 1) * per)
            with autocast("fp16"), np.errstate(over="ignore", invalid="ignore"):
                loss, _ = train_step(model, opt, micro_batches(x[rows, :L], y[rows, :L], cur.step, 7, 1, rows.start),
                                     LR, CLIP, dp=dp, scaler=scaler)
            losses.append(loss)
            cur.advance(L)
        return losses

    def state(run):
        _, _, dp, scaler, cur = run
        shared = {f"scaler.{k}": v for k, v in scaler.state_dict().items()}
        shared.update({f"curriculum.{k}": np.array(v) for k, v in cur.state_dict().items()})
        return {"shared": shared, "per_rank": {f"compression.{k}": v for k, v in dp.state_dict().items()}}

    straight = fresh(11)
    want = steps(straight, 6)
    a = fresh(11)
    first = steps(a, 3)
    layouts.save(COMM, folder, 3, a[0], a[1], state=state(a))
    b = fresh(99)
    layouts.load(COMM, folder, b[0], b[1])
    shared, mine, dropped = layouts.read_state(COMM, folder)
    assert not dropped
    b[3].load_state_dict({k[7:]: v for k, v in shared.items() if k.startswith("scaler.")})
    b[4].load_state_dict({k[11:]: v for k, v in shared.items() if k.startswith("curriculum.")})
    b[2].load_state_dict({k[12:]: v for k, v in mine.items()})
    rest = steps(b, 3)
    assert first + rest == want
    assert b[3].scale == straight[3].scale and b[4].tokens == straight[4].tokens
    for p, q in zip(straight[0].parameters(), b[0].parameters()):
        assert np.array_equal(straight[1].master[id(p)].data, b[1].master[id(q)].data)
        assert np.array_equal(p.data, q.data)


# ----------------------------------------------------------------------------- experts

def test_expert_parallel_resume_and_load_into_one_process(folder):
    """Experts [lo, hi) of E on each rank are boxes of the stacked expert tensors: resume
    bit for bit under expert parallelism, and the whole experts load into one process."""
    below_4()
    import dataclasses
    from minidist.parallel.expert_parallel import expert_parallel
    n = COMM.Get_size()
    cfg = dataclasses.replace(CFG, n_expert=max(2, n), top_k=2, moe_every=1, moe_groups=n)

    def fresh(seed):
        model = GPT(cfg, seed=seed)
        ep = expert_parallel(model, COMM, COMM)
        return model, model.configure_optimizers(0.1, LR), ep

    a = fresh(11)
    want = train(*a, COMM, 0, 3)
    b = fresh(11)
    first = train(*b, COMM, 0, 1)
    layouts.save(COMM, folder, 1, b[0], b[1])
    c = fresh(99)
    layouts.load(COMM, folder, c[0], c[1])
    assert first + train(*c, COMM, 1, 3) == want
    saved = global_weights(folder)
    assert saved["model.transformer.h.0.mlp.c_fc.weight"].shape[0] == max(2, n)
    if COMM.Get_rank() == 0:
        one = GPT(cfg, seed=99)
        one_opt = one.configure_optimizers(0.1, LR)
        layouts.load(MPI.COMM_SELF, folder, one, one_opt)
        for name, p in one.named_parameters():
            assert np.array_equal(p.data, saved[f"model.{name}"]), name
    COMM.Barrier()
