"""Pipeline parallelism against one process, at whatever world size mpirun gives (1, 2, 3, 4, 8).

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_pipeline_parallel.py

p = the world size (at 8: p = 4 x dp = 2). Five layers (not divisible by 2, 3 or 4; the
interleaved runs take 2p layers in 2p chunks), dropout on, float64, three AdamW steps
with clipping that really clips. Per tensor, the loss of each step, every raw gradient
of each step (after the pipeline's sync, before clipping) and every weight at the end
must equal the single-process run's: max_rel_diff <= 1e-10. The run's peak live
activations equal the simulator's, the point-to-point bytes b*s*h per micro-batch per
boundary each way. Every schedule again in float32, held to the harness's float32
tolerance (equivalence.TOLERANCE), and plain SGD without clipping in both dtypes, so a
constant factor would show in the weights too. A micro-batch loss not scaled by 1/m and
a tied embedding whose two copies are not summed must fail the same comparison.
ZB-H1's split is real: every Linear weight of a stage gets its gradient in a W, not in
the B, and the run still equals one process. Six layers on four stages with the extra
layers on the last stages (--extra-layers last) equal one process too.
"""
import importlib
import json

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ProcessGrid, stats
from minidist import equivalence
from minidist.equivalence import mpi_reduce
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD
from minidist.parallel import schedules
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel import pipeline_parallel
from minidist.parallel.pipeline_parallel import PipelineGPT, PipelineParallel, expected_p2p_bytes, split_layers
from minidist.train import TrainConfig, get_lr, micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = ("the schedules are simulated and validated up to p = 8 in tests/test_schedules.py, and the "
       "executor runs pipelines inside 8 ranks in test_3d_parallel.py")

COMM = MPI.COMM_WORLD
WORLD = COMM.Get_size()
PP = WORLD if WORLD <= 4 else 4
T, SEED, STEPS = 8, 11, 3
TC = TrainConfig(max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)


def config(n_layer=5, dtype="float64", dropout=0.1):
    return GPTConfig(block_size=T, vocab_size=64, n_layer=n_layer, n_head=2, n_embd=16, dropout=dropout, dtype=dtype)


def batch(step, rows):
    g = np.random.default_rng([SEED, step])
    x = g.integers(0, 64, (rows, T))
    return x, np.roll(x, -1, axis=1)


def optimizer(model, sgd):
    """AdamW (after clipping) by default; plain SGD, whose update is -lr x g, with sgd=True."""
    return SGD(model.parameters(), lr=TC.learning_rate) if sgd else model.configure_optimizers(0.1, TC.learning_rate)


def train(model, opt, m, rows, dp=None, first=0, n=None, scale_bug=False, clip=TC.grad_clip):
    """STEPS steps on rows first..first+n of each batch; losses, raw grads of every step, weights."""
    losses, state = [], {}
    for step in range(STEPS):
        x, y = batch(step, rows)
        sl = slice(first, first + (n or rows))
        raw = {}
        if scale_bug:                                   # forgets the 1/m of every micro-batch's loss
            fb = dp.forward_backward
            dp.forward_backward = lambda mdl, b, s: fb(mdl, b, 1.0)
        loss, _ = train_step(model, opt, micro_batches(x[sl], y[sl], step, SEED, m, first_sample=first),
                             get_lr(step, TC), clip, dp=dp, raw_grads=raw)
        if scale_bug:
            del dp.forward_backward
        losses.append(loss)
        state.update({f"grad:{k}@step{step}": np.array(g) for k, g in raw.items()})
    state.update({f"weight:{k}": p.data.copy() for k, p in model.named_parameters()})
    return losses, state


def reference(cfg, rows, sgd=False):
    ref = GPT(cfg, seed=SEED)
    return train(ref, optimizer(ref, sgd), 1, rows, clip=0.0 if sgd else TC.grad_clip)


def pipeline(cfg, name, m, v=1, sgd=False, extra_layers="first", **kw):
    grid = ProcessGrid(pp=PP)
    rows = m * grid.dp
    model = PipelineGPT(GPT(cfg, seed=SEED), PP, grid.pp_rank, v, extra_layers)
    dp = NaiveDataParallel(model, grid.dp_comm) if grid.dp > 1 else None
    runner = PipelineParallel(model, grid.pp_comm, name, m, dp)
    if kw.pop("skip_tied", False):
        runner.embed_comm = None
    opt = optimizer(model, sgd)
    with stats.measure() as meas:
        losses, state = train(model, opt, m, rows, runner, first=grid.dp_rank * m, n=m,
                              clip=0.0 if sgd else TC.grad_clip, **kw)
    return grid, model, runner, losses, state, meas, rows


def worst(cfg, name, m, v=1, sgd=False, **kw):
    """max_rel_diff over loss, raw gradients and weights, the largest on any rank."""
    grid, model, runner, losses, state, meas, rows = pipeline(cfg, name, m, v, sgd, **kw)
    ref_losses, ref_state = reference(cfg, rows, sgd)
    losses = list(mpi_reduce(grid.dp_comm, losses, "sum") / grid.dp)
    mine = {k: ref_state[k] for k in state}
    state["loss"], mine["loss"] = np.array(losses), np.array(ref_losses)
    rel, _, where = equivalence.compare(state, mine)
    return mpi_reduce(COMM, rel), where, (grid, model, runner, meas, rows)


@pytest.mark.parametrize("name,m", [("naive", 2), ("gpipe", 1), ("gpipe", 8), ("1f1b", 1), ("1f1b", 3),
                                    ("1f1b", 8), ("zb-h1", 2), ("zb-h1", 7)])
def test_schedule_equals_one_process(name, m):
    rel, where, (grid, model, runner, meas, rows) = worst(config(), name, m)
    assert rel <= 1e-10, f"{name}, p={PP}, m={m}: max_rel_diff {rel:.2e} (worst {where} on some rank)"
    sim = schedules.simulate(runner.schedule, PP, m)
    assert runner.peak_live == sim.peak[grid.pp_rank], "peak live activations differ from the simulator's"
    if name == "gpipe":
        assert runner.peak_live == m
    if name in ("1f1b", "zb-h1"):
        assert runner.peak_live <= PP
    sent = meas.bytes_sent("send") // STEPS
    assert sent == expected_p2p_bytes(model, [1] * m, 8), f"rank {COMM.Get_rank()} sent {sent} bytes per step"


@pytest.mark.parametrize("m", [2, 5])
def test_zb_h1_split_is_real_and_equals_one_process(m, monkeypatch):
    """Every W adds weight gradients the B left: each Linear weight of the stage gets its
    gradient there (its B computed only the input's), and the run equals one process."""
    in_w = set()

    def spy(later):
        in_w.update(id(t) for wg in later if wg.fn is not None for _, t in wg.params)
        run_weight_grads(later)

    run_weight_grads = pipeline_parallel.run_weight_grads
    monkeypatch.setattr(pipeline_parallel, "run_weight_grads", spy)
    rel, where, (grid, model, runner, meas, rows) = worst(config(n_layer=4), "zb-h1", m)
    assert rel <= 1e-10, f"zb-h1 split, p={PP}, m={m}: max_rel_diff {rel:.2e} (worst {where})"
    linears = {n: p for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_fc.weight"))}
    missed = sorted(n for n, p in linears.items() if id(p) not in in_w)
    assert linears and not missed, f"rank {COMM.Get_rank()}: no W computed the gradient of {missed}"
    assert len(runner.durations["W"]) == STEPS * m, "one W per micro-batch and step"


@pytest.mark.parametrize("extra", ["first", "last"])
def test_extra_layers_first_or_last_equals_one_process(extra):
    """An uneven cut (2p - 1 layers: p - 1 stages hold two): the extra layers on the first
    stages or on the last ones, the same training either way."""
    n_layer = 2 * PP - 1
    ranges = split_layers(n_layer, PP, extra)
    sizes = [hi - lo for lo, hi in ranges]
    if PP > 1:
        assert sizes == ([2] * (PP - 1) + [1] if extra == "first" else [1] + [2] * (PP - 1)), sizes
    rel, where, _ = worst(config(n_layer=n_layer), "1f1b", 4, extra_layers=extra)
    assert rel <= 1e-10, f"extra layers {extra}, p={PP}: max_rel_diff {rel:.2e} (worst {where})"


@pytest.mark.parametrize("m", [PP, 2 * PP])
def test_interleaved_equals_one_process(m):
    rel, where, (grid, model, runner, meas, rows) = worst(config(n_layer=2 * PP), "interleaved", m, v=2)
    assert rel <= 1e-10, f"interleaved, p={PP}, v=2, m={m}: max_rel_diff {rel:.2e} (worst {where})"
    assert runner.peak_live == schedules.simulate(runner.schedule, PP, m, 2).peak[grid.pp_rank]
    assert meas.bytes_sent("send") // STEPS == expected_p2p_bytes(model, [1] * m, 8)


@pytest.mark.parametrize("name,m,v", [("naive", 2, 1), ("gpipe", 4, 1), ("1f1b", 3, 1), ("interleaved", PP, 2),
                                      ("zb-h1", 4, 1)])
def test_float32_schedule_equals_one_process(name, m, v):
    """The same comparison in float32, AdamW after clipping, to the lessons' float32 tolerance."""
    cfg = config(n_layer=2 * PP if v == 2 else 5, dtype="float32")
    rel, where, _ = worst(cfg, name, m, v)
    tol = equivalence.TOLERANCE["float32"]
    assert rel <= tol, f"float32 {name}, p={PP}, m={m}: max_rel_diff {rel:.2e} > {tol} (worst {where})"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sgd_without_clipping_equals_one_process(dtype):
    """Nothing between the raw gradients and the weights rescales them: the update is -lr x g."""
    rel, where, _ = worst(config(dtype=dtype), "1f1b", 4, sgd=True)
    tol = equivalence.TOLERANCE[dtype]
    assert rel <= tol, f"{dtype} 1f1b SGD, p={PP}: max_rel_diff {rel:.2e} > {tol} (worst {where})"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_missing_one_over_m_fails(dtype):
    """Clipping then AdamW would hide the factor m in the weights; the raw gradients show it."""
    rel, _, _ = worst(config(dtype=dtype), "1f1b", 4, scale_bug=True)
    assert rel > equivalence.TOLERANCE[dtype] * 100


@pytest.mark.skipif(PP < 2, reason="one stage holds both uses of wte")
def test_tied_embedding_not_summed_fails():
    grid, model, runner, losses, state, meas, rows = pipeline(config(), "1f1b", 4, 1, False, skip_tied=True)
    _, ref_state = reference(config(), rows, False)
    key = "grad:transformer.wte.weight@step0"     # where the bug starts: wte's raw gradient at step 0
    mine = equivalence.compare({key: state[key]}, {key: ref_state[key]})[0] if key in state else 0.0
    held = [k for k in state if "wte" in k]
    assert not held or key in state
    assert mpi_reduce(COMM, mine) > 1e-3            # on the first and the last stage, which hold wte


def test_lesson_runs_and_traces(tmp_path_factory):
    """The lesson at this world size: exit 0 (a match), figures in the report, a Chrome trace
    with one track per rank."""
    lesson = importlib.import_module("minidist.lessons.04_pipeline_parallel")
    folder = tmp_path_factory.mktemp("pp") if COMM.Get_rank() == 0 else None
    folder = COMM.bcast(str(folder) if folder else None, root=0)
    args = lesson.build_parser().parse_args(
        ["--schedule", "zb-h1", "--pp", str(PP), "--n-layer", str(PP + 1), "--n-embd", "16", "--block-size", "8",
         "--batch-size", str(4 * (WORLD // PP)), "--trace", f"{folder}/t.json", "--json", f"{folder}/r.json",
         "--dropout", "0.1"])
    assert lesson.main(args) == 0
    COMM.Barrier()
    if COMM.Get_rank() == 0:
        rep = json.load(open(f"{folder}/r.json"))
        assert rep["match"] and rep["figures"]["bubble_simulated"] == rep["figures"]["bubble_formula"]
        assert rep["figures"]["p2p_bytes_measured"] == rep["figures"]["p2p_bytes_formula"]
        trace = json.load(open(f"{folder}/t.json"))
        tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert tracks == set(range(WORLD))
        assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
