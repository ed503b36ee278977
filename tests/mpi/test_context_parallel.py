"""Context parallelism (ring, Ulysses, all-gather) against one process, at 1, 2, 3, 4 and 8 ranks.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_context_parallel.py

Each variant runs at cp = the world (1 to 4 ranks; at 3 the sequence of 14 tokens makes
2cp = 6 chunks of 3, 3, 2, 2, 2, 2: uneven), with dropout, three AdamW steps with clipping
that really clips, float64: per tensor the loss of each step, every raw gradient of each
step (after the dp x cp average, before clipping) and every weight at the end equal the
single-process GPT's (blockwise attention: its dropout is drawn by position, as CP's is):
max_rel_diff <= 1e-10. The ring also with the naive split and without overlap. The bytes
each rank's attention exchange sent equal plan.context.cp_sent, rank by rank; the score
tiles each rank computed equal plan.context.attention_tiles, every rank the same under load
balancing when each chunk is one tile. At 3 ranks, seq 29 in tiles of 2 (several tiles per
chunk, chunks of 5 and 4 tokens) for the ring and the all-gather. Recompute "full" (the
exchange rerun) and "selective" (the CP core left be). Compositions: CP 2 x TP 2 (with
sequence parallelism too) and CP 2 x DP 2 at 4 ranks, CP 2 x TP 2 x DP 2 at 8. Bad
settings end every rank alike (an agreed error).
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.attention import STATS
from minidist.comm import GridError, ProcessGrid, ring_reduce_scatter_v, stats
from minidist import equivalence
from minidist.equivalence import mpi_reduce
from minidist.model import GPT, GPTConfig
from minidist.parallel.context_parallel import CPError
from minidist.parallel.cp_model import ContextParallelGPT
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync, gather_state
from minidist.plan.context import attention_tiles, cp_sent
from minidist.train import TrainConfig, get_lr, micro_batches, train_step

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
WORLD = COMM.Get_size()
SEED, STEPS, TOL, V, BLOCK = 11, 3, 1e-10, 40, 4
TC = TrainConfig(max_iters=STEPS, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
VARIANTS = ("ring", "ulysses", "allgather")
SEQ = {1: 12, 2: 16, 3: 14, 4: 16}.get(WORLD)      # 14 at cp 3: chunks of uneven length


def config(T, dropout, n_head=12, attention="blockwise", block=BLOCK):
    return GPTConfig(block_size=T, vocab_size=V, n_layer=2, n_head=n_head, n_embd=24, dropout=dropout,
                     dtype="float64", attention=attention, attn_block=block)


def batch(step, rows, T):
    g = np.random.default_rng([SEED, step])
    x = g.integers(0, V, (rows, T))
    return x, np.roll(x, -1, axis=1)


def train(model, sync, rows, T, first=0, n=None, whole=None):
    """STEPS steps on rows first..first+n of each batch: {loss, raw grads, weights}.
    whole: {name: local array} -> {name: whole array} (gathers TP shards)."""
    whole = whole or (lambda arrays: arrays)
    opt, state = model.configure_optimizers(0.1, TC.learning_rate), {}
    n = n or rows
    for step in range(STEPS):
        x, y = batch(step, rows, T)
        raw = {}
        loss, _ = train_step(model, opt, micro_batches(x[first:first + n], y[first:first + n], step, SEED,
                                                       first_sample=first),
                             get_lr(step, TC), TC.grad_clip, dp=sync, raw_grads=raw)
        state[f"loss@step{step}"] = np.array([loss])
        grads = {k: raw[k] if raw[k] is not None else np.zeros(p.shape) for k, p in model.named_parameters()}
        state.update({f"grad:{k}@step{step}": np.array(g) for k, g in whole(grads).items()})
    state.update({f"weight:{k}": np.array(a) for k, a in
                  whole({k: p.data for k, p in model.named_parameters()}).items()})
    return state


_REF = {}


def reference(T, dropout, rows, n_head=12, attention="blockwise"):
    key = (T, dropout, rows, n_head, attention)
    if key not in _REF:
        _REF[key] = train(GPT(config(T, dropout, n_head, attention), seed=SEED), None, rows, T)
    return _REF[key]


def run_cp(variant, cp=None, tp=1, dp=1, T=None, dropout=0.1, load_balance=True, overlap=True,
           sp=False, rows=2, n_head=12, block=BLOCK, recompute="none"):
    """Train the CP model on its grid; returns (grid, model, state with the loss averaged over dp).
    The model it wraps is its own (ContextParallelGPT changes it): references build theirs."""
    T = T or SEQ
    grid = ProcessGrid(tp=tp, cp=cp or WORLD // (tp * dp), dp=dp)
    full = GPT(config(T, dropout, n_head, block=block), seed=SEED).set_recompute(recompute)
    tpm = TensorParallelGPT(full, grid.tp_comm, sequence_parallel=sp) if tp > 1 else None
    model = ContextParallelGPT(tpm or full, grid, variant, load_balance=load_balance, overlap=overlap)
    dpcp = NaiveDataParallel(model, grid.dp_cp_comm)
    sync = TensorParallelSync(tpm, dp=dpcp) if tpm else dpcp
    whole = (lambda arrays: gather_state(tpm, arrays)) if tpm else None
    state = train(model, sync, rows * dp, T, first=grid.dp_rank * rows, n=rows, whole=whole)
    for step in range(STEPS):            # each replica's loss is of its rows: the mean over replicas
        state[f"loss@step{step}"] = mpi_reduce(grid.dp_comm, state[f"loss@step{step}"], "sum") / dp
    return grid, model, state


def check_equal(state, ref, what):
    rel, _, key = equivalence.compare(state, ref)
    worst = mpi_reduce(COMM, rel)
    assert worst <= TOL, f"{what}: max_rel_diff {worst:.2e} > {TOL:.0e} (rank {COMM.Get_rank()}: {key})"


def check_bytes(model, grid, variant, T, rows, heads, load_balance=True):
    """What each rank's attention exchange sent in the whole run == cp_sent x layers x steps."""
    got = sum(model.cp_bytes().values())
    want = STEPS * model.config.n_layer * cp_sent(variant, rows, T, heads, 24 // model.config.n_head, grid.cp,
                                                  grid.cp_rank, 8, load_balance)
    assert got == want, f"{variant}, rank {grid.rank} (cp rank {grid.cp_rank}): sent {model.cp_bytes()}, " \
                        f"cp_sent says {want} in all"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_at_cp_equal_to_the_world(variant):
    if SEQ is None:
        pytest.skip(f"cp = world runs at 1-4 ranks; at {WORLD}, CP 2 x TP 2 x DP 2")
    grid, model, state = run_cp(variant)
    check_equal(state, reference(SEQ, 0.1, 2), f"{variant} cp={WORLD} (seq {SEQ}, dropout 0.1)")
    check_bytes(model, grid, variant, SEQ, 2, 12)


@pytest.mark.parametrize("variant,load_balance,overlap", [("ring", False, True), ("ring", True, False),
                                                          ("allgather", False, True)])
def test_naive_split_and_no_overlap_are_exact_too(variant, load_balance, overlap):
    if SEQ is None or WORLD == 1:
        pytest.skip("at 2-4 ranks")
    grid, model, state = run_cp(variant, load_balance=load_balance, overlap=overlap)
    check_equal(state, reference(SEQ, 0.1, 2), f"{variant} load_balance={load_balance} overlap={overlap}")
    check_bytes(model, grid, variant, SEQ, 2, 12, load_balance)
    if not overlap:                   # every wait is a whole transfer: some time is exposed
        assert model.exposed_s() > 0.0, "the ring without overlap waited for nothing"


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_several_tiles_per_chunk_and_uneven_chunks(variant):
    """seq 29 at cp 3, tiles of 2: chunks of 5 and 4 tokens span 3 and 2 tiles (the tile
    loop inside a chunk, a chunk's last tile partial; the ranks' tile counts differ, 39, 57
    and 57 per layer, while the score elements stay within a token)."""
    if WORLD != 3:
        pytest.skip("at 3 ranks")
    T = 29
    STATS.reset()
    grid, model, state = run_cp(variant, T=T, block=2)
    want = STEPS * model.config.n_layer * attention_tiles(variant, T, 3, grid.cp_rank, 2)
    assert (STATS.tiles_forward, STATS.tiles_backward) == (want, want), (grid.rank, STATS.tiles_forward, want)
    check_equal(state, reference(T, 0.1, 2), f"{variant} cp=3 seq 29 tiles of 2")
    check_bytes(model, grid, variant, T, 2, 12)


def test_ring_backward_has_sent_the_last_accumulator_before_it_sends_the_next(monkeypatch):
    """The ring backward's memory: each dK, dV accumulator it passes on has left (its send
    done) before the next is posted, so a rank holds two in flight, not one per block."""
    if WORLD not in (3, 4):
        pytest.skip("at 3-4 ranks (at 2 a single accumulator travels; at 8, CP 2 x TP 2 x DP 2)")
    import minidist.parallel.context_parallel as cpm
    sends, pending, real = [], [], cpm.ring_pass

    def spy(comm, send_arrays, recv_arrays, tag):
        if tag == cpm.TAG_GRAD:
            pending.append(sum(r != MPI.REQUEST_NULL for r in sends))
        requests = real(comm, send_arrays, recv_arrays, tag)
        if tag == cpm.TAG_GRAD:
            sends.extend(requests[1::2])
        return requests

    monkeypatch.setattr(cpm, "ring_pass", spy)
    model = ContextParallelGPT(GPT(config(SEQ, 0.0), seed=SEED), ProcessGrid(cp=WORLD), "ring",
                               overlap=False)        # no polling: only a wait completes a send
    x, y = batch(0, 2, SEQ)
    model(x, y)[1].backward()
    assert len(pending) == model.config.n_layer * (WORLD - 1) and not any(pending), pending


@pytest.mark.parametrize("variant,policy", [("ring", "full"), ("allgather", "selective")])
def test_with_activation_recompute(variant, policy):
    """full: each block's forward, the attention's exchange included, runs again in
    backward: still exact, and the counters count the rerun (more than cp_sent's forward +
    backward). selective: the CP core keeps no s x s array, so it is left be: exact, and
    exactly cp_sent's bytes."""
    if SEQ is None or WORLD == 1:
        pytest.skip("at 2-4 ranks")
    grid, model, state = run_cp(variant, recompute=policy)
    check_equal(state, reference(SEQ, 0.1, 2), f"{variant} with recompute {policy!r}")
    assert model.model.recompute.name == policy
    if policy == "selective":
        check_bytes(model, grid, variant, SEQ, 2, 12)
    else:
        once = STEPS * model.config.n_layer * cp_sent(variant, 2, SEQ, 12, 2, grid.cp, grid.cp_rank, 8)
        assert sum(model.cp_bytes().values()) > once, (model.cp_bytes(), once)


def test_without_dropout_equal_to_the_plain_attention():
    """No dropout: CP equals the one process with the plain (T, T) attention as well."""
    if SEQ is None:
        pytest.skip("at 1-4 ranks")
    _, _, state = run_cp("ring", dropout=0.0)
    check_equal(state, reference(SEQ, 0.0, 2, attention="plain"), "ring against plain attention")


@pytest.mark.parametrize("load_balance", [True, False])
def test_tiles_per_rank(load_balance):
    """Score tiles of one forward per rank == attention_tiles; with chunks of one tile each,
    the zigzag gives every rank the same tiles."""
    if SEQ is None or WORLD == 1:
        pytest.skip("at 2-4 ranks")
    T = 8 * WORLD                     # chunks of 4 = BLOCK: one tile each
    grid = ProcessGrid(cp=WORLD)
    model = ContextParallelGPT(GPT(config(T, 0.0), seed=SEED), grid, "ring", load_balance=load_balance)
    x, y = batch(0, 2, T)
    STATS.reset()
    model(x, y)[1].backward()
    mine = (STATS.tiles_forward, STATS.tiles_backward)
    want = model.config.n_layer * attention_tiles("ring", T, WORLD, grid.cp_rank, BLOCK, load_balance)
    assert mine == (want, want), f"rank {grid.rank}: tiles (forward, backward) {mine}, formula {want}"
    everyone = np.empty(WORLD, np.int64)
    COMM.Allgather(np.array([mine[0]], np.int64), everyone)
    if load_balance:
        assert everyone.max() == everyone.min(), f"balanced tiles per rank {everyone}"
    else:
        assert everyone[-1] > everyone[0], f"naive split: the last rank must do more, {everyone}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_cp2_tp2_and_cp2_dp2(variant):
    """CP 2 x TP 2 (the ring's with sequence parallelism as well: each TP rank holds half of
    its CP rank's tokens between the tensor-parallel regions) and CP 2 x DP 2."""
    if WORLD != 4:
        pytest.skip("at 4 ranks")
    grid, model, state = run_cp(variant, cp=2, tp=2, sp=variant == "ring")
    check_equal(state, reference(SEQ, 0.1, 2), f"{variant} cp2 x tp2")
    check_bytes(model, grid, variant, SEQ, 2, 6)
    grid, model, state = run_cp(variant, cp=2, dp=2)
    check_equal(state, reference(SEQ, 0.1, 4), f"{variant} cp2 x dp2")
    check_bytes(model, grid, variant, SEQ, 2, 12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cp2_tp2_dp2(variant):
    if WORLD != 8:
        pytest.skip("at 8 ranks")
    T = 12
    grid, model, state = run_cp(variant, cp=2, tp=2, dp=2, T=T)
    check_equal(state, reference(T, 0.1, 4), f"{variant} cp2 x tp2 x dp2")
    check_bytes(model, grid, variant, T, 2, 6)


def test_ring_reduce_scatter_v_keeps_each_ranks_own_length():
    """comm.ring_reduce_scatter_v: the sum over ranks, rank r keeping lengths[r] rows of
    `axis` (one of them empty); it sends every piece's partial sum but its own."""
    lengths = [(3 + r) % 4 for r in range(WORLD)]           # 3, 0, 1, 2, 3, ...
    x = np.random.default_rng([SEED, COMM.Get_rank()]).normal(size=(2, sum(lengths), 3))
    whole = np.empty((WORLD,) + x.shape)
    COMM.Allgather(x, whole)
    with stats.measure() as m:
        got = ring_reduce_scatter_v(COMM, x, lengths, axis=1)
    lo = sum(lengths[:COMM.Get_rank()])
    assert got.shape == (2, lengths[COMM.Get_rank()], 3)
    assert np.allclose(got, whole.sum(0)[:, lo:lo + got.shape[1]], rtol=1e-13, atol=1e-13)
    sent = m["reduce_scatter"]["bytes_sent"] if WORLD > 1 else 0          # one rank sends nothing
    assert sent == (x.size - got.size) * 8, (sent, x.size, got.size)


def raised_everywhere(exc, fn):
    with pytest.raises(exc) as err:
        fn()
    count = np.empty(1, np.int64)
    COMM.Allreduce(np.ones(1, np.int64), count)
    assert count[0] == WORLD
    return str(err.value)


def test_bad_settings_raise_an_agreed_error_on_every_rank():
    grid = ProcessGrid(cp=WORLD)
    msg = raised_everywhere(CPError, lambda: ContextParallelGPT(GPT(config(12, 0.0)), grid, "zigzag"))
    assert "unknown context-parallel variant 'zigzag'" in msg
    if WORLD > 1:
        heads = WORLD + 1             # never divisible by the world
        cfg = GPTConfig(block_size=12, vocab_size=V, n_layer=1, n_head=heads, n_embd=2 * heads, dtype="float64")
        msg = raised_everywhere(CPError, lambda: ContextParallelGPT(GPT(cfg), grid, "ulysses"))
        assert f"{heads} heads do not divide by {WORLD}" in msg, msg
    if WORLD in (2, 4, 8):
        msg = raised_everywhere(GridError, lambda: ProcessGrid(cp=3))
        assert "cp=3" in msg and "does not divide" in msg, msg
    if WORLD > 1:                     # fewer tokens than 2 cp chunks
        model = ContextParallelGPT(GPT(config(2 * WORLD, 0.0)), grid, "ring")
        x = np.zeros((1, 2 * WORLD - 1), np.int64)
        msg = raised_everywhere(CPError, lambda: model(x, x))
        assert f"cannot be cut into 2 cp = {2 * WORLD} chunks" in msg, msg


def test_planted_loss_not_scaled_by_cp_fails(monkeypatch):
    """Without the backward's x cp, each rank's gradient is its tokens' share and the
    dp x cp average is 1/cp of the truth: the raw gradients must show it."""
    if SEQ is None or WORLD == 1:
        pytest.skip("at 2-4 ranks")
    import minidist.parallel.cp_model as cpm
    monkeypatch.setattr(cpm.SumOverContext, "backward", staticmethod(lambda ctx, grad: grad))
    _, _, state = run_cp("ring")
    ref = reference(SEQ, 0.1, 2)
    grads = [k for k in state if k.startswith("grad:")]
    rel = mpi_reduce(COMM, equivalence.compare({k: state[k] for k in grads}, {k: ref[k] for k in grads})[0])
    assert rel > 1e3 * TOL, f"planted: gradients not scaled by cp passed, max_rel_diff {rel:.2e}"
