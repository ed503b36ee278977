"""Tensor parallelism against one process, at whatever world size mpirun gives (1, 2, 3, 4).

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_tensor_parallel.py

The GPT has 24 heads (they divide by every tensor-parallel size tested) and a vocabulary
of 250 (padded at t = 3, 4, 8). Three AdamW steps with clipping that really clips; per
tensor, the loss of each step, every raw gradient of each step (after the gradient
syncs, before clipping: a constant factor must not slip through) and every weight at the
end, gathered whole, must equal the single-process run's: max_rel_diff <= 1e-10 in
float64, the harness's tolerance in float32. Bytes each rank sends equal the formula.
Sequence parallelism runs both ways: Megatron's (c_attn and c_fc keep their slice and
gather it again in backward: 6 all-gathers and 4 reduce-scatters per layer) and
keeping the gathered input (4 and 4).
"""
import functools
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ProcessGrid, chunk_bounds, stats
from minidist.data import shard_slice
from minidist import equivalence
from minidist.equivalence import mpi_reduce
from minidist.model import GPT, GPTConfig
from minidist.parallel import sequence_parallel, tensor_parallel as tpm, tp_model
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.tp_formulas import expected_bytes
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync, gather_state
from minidist.train import TrainConfig, get_lr, micro_batches, train_step

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = ("t = 2, 3 and 4 (uneven at 3) and TP x DP at 4; tensor parallelism inside 8 ranks runs in "
       "test_3d_parallel.py (tp 4 x pp 2, tp 2 x pp 2 x dp 2), and lesson 03's demo runs t = 8")

COMM = MPI.COMM_WORLD
WORLD = COMM.Get_size()
BATCH, T, V, SEED, STEPS = 24, 8, 250, 7, 3      # 24 sequences divide by every dp size tested
TC = TrainConfig(batch_size=BATCH, max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)


def config(dtype="float64", dropout=0.0):
    return GPTConfig(block_size=T, vocab_size=V, n_layer=2, n_head=24, n_embd=48, dropout=dropout, dtype=dtype)


def batch(step):
    g = np.random.default_rng([SEED, step])
    return g.integers(0, V, (BATCH, T)), g.integers(0, V, (BATCH, T))


def train(model, opt, sync, rows, clip):
    """STEPS steps on rows `rows` of each global batch: (losses, [raw grads per step], norms)."""
    losses, raws, norms = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        mb = micro_batches(x[rows], y[rows], step, SEED, 1, first_sample=rows.start or 0)
        raw = {}
        loss, norm = train_step(model, opt, mb, get_lr(step, TC), clip, dp=sync, raw_grads=raw)
        losses.append(loss)
        raws.append(raw)
        norms.append(norm)
    return losses, raws, norms


def adamw(model):
    return model.configure_optimizers(TC.weight_decay, TC.learning_rate, (TC.beta1, TC.beta2))


@functools.lru_cache(maxsize=None)
def reference(dtype, dropout):
    """{name: array} of the single-process run (every rank computes it; no messages)."""
    model = GPT(config(dtype, dropout), seed=SEED)
    losses, raws, _ = train(model, adamw(model), None, slice(None), TC.grad_clip)
    state = {"loss": np.array(losses)}
    for step, raw in enumerate(raws):
        state.update({f"grad{step}:{n}": g for n, g in raw.items()})
    state.update({f"weight:{n}": p.data.copy() for n, p in model.named_parameters()})
    return state


def run_tp(tp=WORLD, sp=False, dtype="float64", dropout=0.0, keep_gathered=False):
    """Train the tensor-parallel model (x data parallel over the rest of the world).

    Returns (max_rel_diff over the world, the model, the grid, what this rank sent).
    keep_gathered: under sp, the variant without the re-gather (sp_keep_gathered).
    """
    grid = ProcessGrid(tp=tp)
    model = TensorParallelGPT(GPT(config(dtype, dropout), seed=SEED), grid.tp_comm, sequence_parallel=sp,
                              sp_keep_gathered=keep_gathered)
    dp = NaiveDataParallel(model, grid.dp_comm) if grid.dp > 1 else None
    sync = TensorParallelSync(model, dp=dp)                        # supplies the global norm
    rows = shard_slice(BATCH, grid.dp_rank, grid.dp)
    with stats.measure() as sent:
        losses, raws, norms = train(model, adamw(model), sync, rows, TC.grad_clip)
    assert min(norms) > TC.grad_clip, f"clipping must really clip: norms {norms} not all above {TC.grad_clip}"
    state = {"loss": mpi_reduce(grid.dp_comm, losses, "sum") / grid.dp}
    for step, raw in enumerate(raws):
        state.update(gather_state(model, raw, prefix=f"grad{step}:"))
    state.update(gather_state(model, prefix="weight:"))
    rel, _, worst = equivalence.compare(state, reference(dtype, dropout))
    return mpi_reduce(COMM, rel), model, grid, sent, worst


def dp_sizes():
    return [t for t in (1, 2, 4) if WORLD % t == 0 and t < WORLD]

# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_float64_matches_one_process(sp, dropout):
    rel, model, _, _, worst = run_tp(sp=sp, dropout=dropout)
    assert rel <= 1e-10, (f"tp={WORLD}, sequence parallel {sp}, dropout {dropout}: max_rel_diff "
                          f"{rel:.2e} > 1e-10 (worst on this rank: {worst})")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_float32_within_the_harness_tolerance(sp):
    rel, _, _, _, worst = run_tp(sp=sp, dtype="float32")
    tol = equivalence.TOLERANCE["float32"]
    assert rel <= tol, f"float32, sequence parallel {sp}: max_rel_diff {rel:.2e} > {tol} ({worst})"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_times_dp_matches_one_process(tp, sp):
    """tp x dp = world through the ProcessGrid (tp fastest), with dropout."""
    if tp not in dp_sizes():
        pytest.skip(f"tp={tp} does not leave a data-parallel factor of {WORLD} ranks")
    rel, model, grid, sent, worst = run_tp(tp=tp, sp=sp, dropout=0.1)
    assert rel <= 1e-10, f"tp={tp} x dp={grid.dp}, sp {sp}: max_rel_diff {rel:.2e} > 1e-10 ({worst})"
    want = step_bytes(model, BATCH // grid.dp, grid)
    got = {n: (sent[n]["calls"] // STEPS, sent.bytes_sent(n) // STEPS) for n in want}
    assert got == want, f"tp={tp} x dp={grid.dp}: measured (calls, bytes) per step {got}, formula {want}"


@pytest.mark.parametrize("dropout", [0.1])                      # 0.0: test_bytes_per_rank_equal_the_formula
def test_sp_keeping_the_gathered_input_matches_one_process(dropout):
    """The naive variant (sp_keep_gathered: no re-gather in backward) gives the same numbers."""
    rel, model, _, _, worst = run_tp(sp=True, dropout=dropout, keep_gathered=True)
    assert model.sp_keep_gathered and all(m.keep_gathered for m in column_layers(model))
    assert rel <= 1e-10, f"tp={WORLD}, sp kept gathered, dropout {dropout}: max_rel_diff {rel:.2e} ({worst})"


def column_layers(model):
    return [m for b in model.transformer.h for m in (b.attn.c_attn, b.mlp.c_fc)]


def test_replicated_parameters_stay_identical_across_the_group():
    _, model, grid, _, _ = run_tp(sp=True, dropout=0.1)
    for name in model.replicated_names():
        p = dict(model.named_parameters())[name]
        crc = np.array([zlib.crc32(np.ascontiguousarray(p.data).tobytes())], np.int64)
        every = np.empty(grid.tp, np.int64)
        grid.tp_comm.Allgather(crc, every)
        assert len(set(every.tolist())) == 1, f"{name} differs across the tensor-parallel group"

# ----------------------------------------------------------------------------- uneven sequence chunks


def test_sequence_bounds_are_the_collectives_chunks():
    """For every T up to 2t + 2: the tokens sequence_bounds gives this rank are the chunk the
    reduce-scatter along the sequence hands it, and the all-gather of those chunks is the
    whole sequence in order (array_split's chunks, not ceil-sized ones)."""
    for n in range(1, 2 * WORLD + 3):
        x = np.arange(2 * n * 3, dtype=np.float64).reshape(2, n, 3)
        lo, hi = sequence_parallel.sequence_bounds(n, COMM)
        mine = np.asarray(sequence_parallel._reduce_scatter(COMM, x))
        assert mine.shape == (2, hi - lo, 3), (f"T={n}, t={WORLD}, rank {COMM.Get_rank()}: sequence_bounds gives "
                                               f"tokens [{lo}, {hi}), the reduce-scatter {mine.shape[1]} of them")
        assert np.array_equal(mine, WORLD * x[:, lo:hi]), f"T={n}: the reduce-scatter's chunk is not [{lo}, {hi})"
        whole = np.asarray(sequence_parallel._all_gather(COMM, x[:, lo:hi]))
        assert np.array_equal(whole, x), f"T={n}: the all-gather of the bounds' chunks is not the sequence"


def uneven_length():
    """A sequence length T with T mod t outside {0, t-1}, where array_split's chunks differ from
    ceil(T/t)-sized ones (None below t = 3: there the two cuts agree for every T)."""
    return WORLD + 1 if WORLD >= 3 else None


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sequence_parallel_at_an_uneven_length(dropout):
    """One step of tp + sp at T = t + 1 (t = 3: chunks 2, 1, 1), dropout on and off: the loss
    and every raw gradient equal one process's."""
    n = uneven_length()
    if n is None:
        pytest.skip(f"at t={WORLD} every sequence length cuts the same way either way")
    cfg = GPTConfig(block_size=n, vocab_size=V, n_layer=1, n_head=24, n_embd=48, dropout=dropout, dtype="float64")
    g = np.random.default_rng([SEED, n])
    x, y = g.integers(0, V, (2, n)), g.integers(0, V, (2, n))
    got = {}
    for name, model in (("one process", GPT(cfg, seed=SEED)),
                        ("tp+sp", TensorParallelGPT(GPT(cfg, seed=SEED), COMM, sequence_parallel=True))):
        sync = TensorParallelSync(model) if name == "tp+sp" else None
        raw = {}
        loss, _ = train_step(model, adamw(model), micro_batches(x, y, 0, SEED, 1), 1e-3, 0.0, dp=sync, raw_grads=raw)
        state = (gather_state(model, raw, prefix="grad:") if name == "tp+sp"
                 else {f"grad:{k}": v for k, v in raw.items()})
        got[name] = dict(state, loss=np.array([loss]))
    rel, _, worst = equivalence.compare(got["tp+sp"], got["one process"])
    assert mpi_reduce(COMM, rel) <= 1e-10, f"T={n}, t={WORLD}, dropout {dropout}: max_rel_diff {rel:.2e} in {worst}"

# ----------------------------------------------------------------------------- bytes


def step_bytes(model, rows, grid=None):
    """Formula: {collective: (calls, bytes)} per step, TP group plus the dp average."""
    return expected_bytes(model, rows, T, dp_comm=None if grid is None else grid.dp_comm)


@pytest.mark.parametrize("sp,keep", [(False, False), (True, False), (True, True)],
                         ids=["tp", "tp+sp", "tp+sp kept gathered"])
def test_bytes_per_rank_equal_the_formula(sp, keep):
    rel, model, _, sent, _ = run_tp(sp=sp, keep_gathered=keep)
    assert rel <= 1e-10, f"sequence parallel {sp}, kept gathered {keep}: max_rel_diff {rel:.2e}"
    want = step_bytes(model, BATCH)
    got = {n: (sent[n]["calls"] // STEPS, sent.bytes_sent(n) // STEPS) for n in want}
    assert got == want, f"sequence parallel {sp}: measured (calls, bytes) per step {got}, formula {want}"
    assert set(n for n in sent if n != "check") == set(want), f"unexpected collectives: {sorted(sent)}"
    if sp and WORLD > 1:
        by_hand_sequence_collectives(model, sent, keep)


def by_hand_sequence_collectives(model, sent, keep):
    """Counted by hand, not by expected_bytes: per layer, forward and backward, 4 reduce-scatters
    and 6 all-gathers with the re-gather (4 kept gathered); plus the embedding's and the head's
    pair. Each all-gather sends b*s*h less its right neighbour's chunk of the sequence."""
    L = model.config.n_layer
    gathers, scatters = (4 if keep else 6) * L + 2, 4 * L + 2
    calls = (sent["all_gather"]["calls"] // STEPS, sent["reduce_scatter"]["calls"] // STEPS)
    assert calls == (gathers, scatters), (f"kept gathered {keep}: (all-gathers, reduce-scatters) per step "
                                          f"{calls}, by hand {(gathers, scatters)}")
    b, right = chunk_bounds(T, WORLD), (COMM.Get_rank() + 1) % WORLD
    per_call = BATCH * (T - (b[right + 1] - b[right])) * 48 * 8           # all but my right neighbour's chunk
    assert sent.bytes_sent("all_gather") // STEPS == gathers * per_call


def test_no_collective_moves_the_logits(monkeypatch):
    """Every array that enters a collective has b*s*h, b*s or one element (or, under
    sequence parallelism, the replicated gradients): never the b*s*v logits."""
    sizes = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda comm, a, *k, **kw: sizes.append(a.size) or real(comm, a, *k, **kw))

    spy(tpm, "_all_reduce")
    spy(sequence_parallel, "_all_gather")
    spy(sequence_parallel, "_reduce_scatter")
    _, model, _, _, _ = run_tp(sp=True)
    _, _, _, _, _ = run_tp(sp=False)
    n_rep = sum(p.size for n, p in model.named_parameters() if n not in model.specs)
    lo, hi = sequence_parallel.sequence_bounds(T, COMM)
    allowed = {BATCH * T * 48, BATCH * (hi - lo) * 48, BATCH * T, 1, n_rep}
    assert set(sizes) <= allowed, f"collective sizes {sorted(set(sizes) - allowed)} outside {sorted(allowed)}"
    assert max(sizes) < BATCH * T * V

# ----------------------------------------------------------------------------- the test can fail


def test_a_planted_bug_is_caught(monkeypatch):
    """g's backward all-reducing too (instead of identity) multiplies gradients by t (g_backward is
    what both the row-parallel layer and g after the embedding call)."""
    monkeypatch.setattr(tpm, "g_backward", lambda comm, grad: tpm._all_reduce(comm, grad))
    rel, _, _, _, worst = run_tp()
    if WORLD > 1:
        assert rel > 1e-3, f"the planted bug went unnoticed: max_rel_diff {rel:.2e}"
    else:
        assert rel <= 1e-10, f"with one rank the all-reduce is the identity, yet {rel:.2e} ({worst})"


def test_unsliced_attention_dropout_is_caught(monkeypatch):
    """Each rank drawing its own heads' masks from the start (rank 0's heads) must fail."""
    monkeypatch.setattr(tpm.SlicedRNG, "mask", lambda self, shape, p, dtype: self.rng.mask(shape, p, dtype))
    rel, _, _, _, _ = run_tp(dropout=0.1)
    if WORLD > 1:
        assert rel > 1e-3, f"unsliced dropout masks went unnoticed: max_rel_diff {rel:.2e}"


def test_heads_that_do_not_divide_are_refused():
    """Found alike on every rank: each raises, none waits."""
    if WORLD % 5 == 0:
        pytest.skip("5 heads divide among this many ranks")
    cfg = GPTConfig(block_size=T, vocab_size=V, n_layer=1, n_head=5, n_embd=40, dtype="float64")
    if WORLD == 1:
        TensorParallelGPT(GPT(cfg, seed=0), COMM)
        return
    with pytest.raises(tp_model.TPError, match="multiple of the tensor-parallel size"):
        TensorParallelGPT(GPT(cfg, seed=0), COMM)


def test_clipping_by_the_shards_norm_is_caught(monkeypatch):
    """Clipping each rank's shards by their own norm (the plain clip_grad_norm, without the
    dp slot's global norm) gives the right raw gradients but wrong weights: the
    comparison of weights must catch it."""
    from minidist.optim import grad_norm_sq
    monkeypatch.setattr(TensorParallelSync, "grad_norm_sq", lambda self, params: grad_norm_sq(params))
    rel, _, _, _, worst = run_tp()
    if WORLD > 1:
        assert rel > 1e-6 and worst.startswith("weight:"), f"local clipping went unnoticed: {rel:.2e} ({worst})"
