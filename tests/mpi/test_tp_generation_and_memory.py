"""Tensor-parallel generation and activation memory, at whatever world size mpirun gives.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_tp_generation_and_memory.py

Generation: the sharded model with a KV cache of its own heads must choose the very
tokens the single-process model chooses without a cache, its logits (each rank's
vocabulary columns) within 1e-12 of that model's at every step in float64, past
block_size too; padded vocabulary columns never win. Bytes sent equal the formula.
Activation memory: the engine's meter, for one layer, equals this engine's count
(plan.memory.engine_layer_elements) for one process, tensor parallel and sequence
parallel (both variants), with and without dropout, uneven sequence chunks included; and
Korthikanti et al.'s identity holds as measured: the sequence-parallel layer (Megatron's,
with the re-gather) summed over the ranks is the one-process layer exactly, and t times
one rank's is within 3% of it (exactly where t divides the sequence).
"""
import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import stats
from minidist.model import GPT, GPTConfig, LayerKV, cached_attention, generate_greedy
from minidist.parallel.sequence_parallel import sequence_bounds
from minidist.parallel.tensor_parallel import padded_vocab, vocab_parallel_argmax, vocab_range
from minidist.parallel.tp_formulas import generation_bytes, generation_feeds, measured_saved_bytes
from minidist.parallel.tp_model import TensorParallelGPT
from minidist.plan.memory import engine_layer_elements
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "t = 2, 3 and 4 show the identity, the bytes and the tokens; lesson 03 runs t = 8"

COMM = MPI.COMM_WORLD
WORLD, RANK = COMM.Get_size(), COMM.Get_rank()
V, T = 250, 8                                    # V padded at t = 3, 4, 8


def config(dtype="float64", dropout=0.0):
    return GPTConfig(block_size=T, vocab_size=V, n_layer=2, n_head=24, n_embd=48, dropout=dropout, dtype=dtype)


def agree_max(x):
    out = np.empty(1)
    COMM.Allreduce(np.array([float(x)]), out, op=MPI.MAX)
    return float(out[0])


def generate_both(sp=False, dtype="float64", prompt=3, n=9):
    """(tokens, logits) of the sharded model with its cache, and of one process without one."""
    idx = np.random.default_rng(4).integers(0, V, (2, prompt))
    tp = TensorParallelGPT(GPT(config(dtype), seed=1), COMM, sequence_parallel=sp)
    ref = GPT(config(dtype), seed=1)
    return tp, generate_greedy(tp, idx, n), generate_greedy(ref, idx, n, use_cache=False)


def logits_rel_diff(tp, mine, whole):
    """Per step, max|a - b| / max|b| over the vocabulary, from each rank's columns."""
    lo, cols = tp.lo, max(0, min(tp.lo + mine[0].shape[-1], V) - tp.lo)
    worst = 0.0
    for a, b in zip(mine, whole):
        b = np.asarray(b)
        d = agree_max(np.abs(a[:, :cols] - b[:, lo:lo + cols]).max(initial=0.0))
        worst = max(worst, d / np.abs(b).max())
    return worst


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("prompt,n", [(3, 6), (3, 9)], ids=["in the block", "past the block"])
def test_sharded_generation_equals_one_process(sp, prompt, n):
    tp, (tokens, logits), (want, want_logits) = generate_both(sp, prompt=prompt, n=n)
    rel = logits_rel_diff(tp, logits, want_logits)
    assert rel <= 1e-12, f"t={WORLD}: logits differ from one process by {rel:.2e}"
    assert np.array_equal(tokens, want), f"t={WORLD}: tokens\n{tokens}\nbut one process chose\n{want}"


def test_float32_tokens_equal_one_process():
    tp, (tokens, logits), (want, want_logits) = generate_both(dtype="float32")
    assert np.array_equal(tokens, want)
    assert logits_rel_diff(tp, logits, want_logits) <= 1e-5


def test_a_cache_that_forgets_the_past_is_caught(monkeypatch):
    """Each rank attending only to the new positions (a cache that stores nothing) must fail."""
    def forgetful(self, q, k, v):
        self.length += k.shape[2]                             # advances, but keeps nothing
        return cached_attention(q, k, v, 0)

    monkeypatch.setattr(LayerKV, "attend", forgetful)
    tp, (tokens, logits), (want, want_logits) = generate_both()
    assert logits_rel_diff(tp, logits, want_logits) > 1e-3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_generation_bytes_equal_the_formula(dtype):
    """In float32 too: the token ids' all-reduce is int64 whatever the activations' dtype
    (in float64 alone, ids counted at the activations' itemsize would pass)."""
    tp = TensorParallelGPT(GPT(config(dtype), seed=1), COMM)
    idx = np.zeros((2, 3), np.int64)
    with stats.measure() as m:
        generate_greedy(tp, idx, 9)
    want = [generation_bytes(tp, 2, f)["all_reduce"] for f in generation_feeds(3, 9, T)]
    got = (m["all_reduce"]["calls"] if WORLD > 1 else 0, m.bytes_sent("all_reduce"))
    assert generation_feeds(3, 9, T) == [3, 1, 1, 1, 1, 1, 8, 8, 8]
    assert got[1] == sum(b for _, b in want), f"{dtype}: bytes {got[1]}, formula {sum(b for _, b in want)}"
    if WORLD > 1:
        assert got[0] == sum(c for c, _ in want)
    assert set(n for n in m if n != "check") <= {"all_reduce"}

# ----------------------------------------------------------------------------- the token from split logits


@pytest.mark.parametrize("case", ["negative logits", "a tie across ranks"])
def test_argmax_of_split_logits(case):
    """Real logits all negative: padded columns (logit 0 from the zero rows) must not win.
    A tie between ids of different ranks: the smallest id, as numpy.argmax picks."""
    vocab = 4 * WORLD - 1 if WORLD > 1 else 7                 # padded by one column from t = 2
    Vp = padded_vocab(vocab, WORLD)
    g = np.random.default_rng(9)
    whole = -1.0 - g.random((5, Vp))
    if case == "a tie across ranks":
        whole[:, [1, vocab - 1]] = -0.5                       # id 1 on rank 0, the last id on the last rank
    whole[:, vocab:] = 0.0                                    # what the zero rows of the table give
    lo, hi = vocab_range(vocab, WORLD, RANK)
    got = vocab_parallel_argmax(whole[:, lo:hi], lo, vocab, COMM)
    want = np.argmax(whole[:, :vocab], axis=1)
    assert np.array_equal(got, want), f"{case}: chose {got}, one process {want}"
    if Vp > vocab:
        assert not np.array_equal(np.argmax(whole, axis=1), want), "the padding must be able to win unmasked"

# ----------------------------------------------------------------------------- activation memory of one layer


def measured_layers(dropout, s=T):
    """{case: (bytes the meter reads for one layer's forward on this rank, engine count args)}."""
    cfg = dataclasses.replace(config(dropout=dropout), block_size=s)
    b, h = 3, cfg.n_embd
    x = np.random.default_rng(0).standard_normal((b, s, h))
    lo, hi = sequence_bounds(s, COMM)

    def rng():
        return DropoutRNG(0, 0, range(b)) if dropout else None

    def layer(**kw):
        return TensorParallelGPT(GPT(cfg, seed=0), COMM, **kw).transformer.h[0]

    one, tp = GPT(cfg, seed=0).transformer.h[0], layer()
    sp, kept = layer(sequence_parallel=True), layer(sequence_parallel=True, sp_keep_gathered=True)
    mine = x[:, lo:hi]
    cases = {"one process": (lambda: one(Tensor(x), rng()), dict(t=1)),
             "tp": (lambda: tp(Tensor(x), rng(), None), dict(t=WORLD)),
             "tp+sp": (lambda: sp(Tensor(mine), rng(), (s, lo, hi)), dict(t=WORLD, s_r=hi - lo, regather=True)),
             "tp+sp kept gathered": (lambda: kept(Tensor(mine), rng(), (s, lo, hi)), dict(t=WORLD, s_r=hi - lo, regather=False))}
    return {name: (measured_saved_bytes(forward), shape) for name, (forward, shape) in cases.items()}, (b, s, h)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_meter_equals_the_engines_count(dropout):
    a = config().n_head
    cases, (b, s, h) = measured_layers(dropout)
    for name, (measured, shape) in cases.items():
        count = sum(engine_layer_elements(b, s, h, a, dropout=dropout > 0, **shape).values()) * 8
        assert measured == count, f"{name}, t={WORLD}, dropout {dropout}: meter {measured} B, count {count} B"
        without_masks = sum(engine_layer_elements(b, s, h, a, dropout=False, **shape).values()) * 8
        assert (measured == without_masks) == (dropout == 0), f"{name}: the masks must show in the meter"


@pytest.mark.parametrize("s", [T, 2 * T + 1], ids=["T", "2T+1"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sequence_parallel_layer_is_one_process_over_t(dropout, s):
    """Korthikanti et al.'s 34sbh/t + 5as^2b/t is the one-process layer over t: measured, the
    re-gather layer summed over the ranks equals one process's exactly; t times this rank's
    is within 3% of it, and exactly equal where t divides s (2T+1 is uneven from t = 2)."""
    cases, _ = measured_layers(dropout, s)
    one, mine = cases["one process"][0], cases["tp+sp"][0]
    summed = COMM.allreduce(mine)
    assert summed == one, f"t={WORLD}, s={s}, dropout {dropout}: TP + SP summed over ranks {summed} B, " \
                          f"one process {one} B"
    if s % WORLD == 0:                                   # every rank holds s/t tokens
        ratio = WORLD * agree_max(mine) / one
        assert abs(ratio - 1) <= 0.03, f"t={WORLD}, s={s}: t x the largest rank / one process = {ratio:.3f}"
        assert WORLD * mine == one, f"t={WORLD}, s={s}: t x {mine} B, one process {one} B"
    kept = COMM.allreduce(cases["tp+sp kept gathered"][0])
    assert (kept == one) == (WORLD == 1), f"keeping the gathered inputs must cost more at t={WORLD}: {kept} B"
