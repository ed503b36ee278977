"""Tensor-parallel generation and activation memory, at whatever world size mpirun gives.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_tp_generation_and_memory.py

Generation: the sharded model with a KV cache of its own heads must choose the very
tokens the single-process model chooses without a cache, its logits (each rank's
vocabulary columns) within 1e-12 of that model's at every step in float64, past
block_size too; padded vocabulary columns never win. Bytes sent equal the formula.
Activation memory: the engine's meter, for one layer, equals this engine's count
(tp_formulas.engine_layer_elements) for one process, tensor parallel and sequence
parallel, with and without dropout, uneven sequence chunks included.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import stats
from minidist.model import GPT, GPTConfig, LayerKV, cached_attention, generate_greedy
from minidist.parallel.sequence_parallel import sequence_bounds
from minidist.parallel.tensor_parallel import padded_vocab, vocab_parallel_argmax, vocab_range
from minidist.parallel.tp_formulas import (engine_layer_elements, generation_bytes, generation_feeds,
                                           measured_saved_bytes)
from minidist.parallel.tp_model import TensorParallelGPT
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor

pytestmark = pytest.mark.mpi

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


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_meter_equals_the_engines_count(dropout):
    cfg = config(dropout=dropout)
    b, s, h, a = 3, T, cfg.n_embd, cfg.n_head
    x = np.random.default_rng(0).standard_normal((b, s, h))
    lo, hi = sequence_bounds(s, COMM)

    def rng():
        return DropoutRNG(0, 0, range(b)) if dropout else None

    one = GPT(cfg, seed=0).transformer.h[0]
    tp = TensorParallelGPT(GPT(cfg, seed=0), COMM).transformer.h[0]
    sp = TensorParallelGPT(GPT(cfg, seed=0), COMM, sequence_parallel=True).transformer.h[0]
    cases = {"one process": (lambda: one(Tensor(x), rng()), dict(t=1)),
             "tp": (lambda: tp(Tensor(x), rng(), None), dict(t=WORLD)),
             "tp+sp": (lambda: sp(Tensor(x[:, lo:hi]), rng(), (s, lo, hi)), dict(t=WORLD, s_r=hi - lo))}
    for name, (forward, shape) in cases.items():
        measured = measured_saved_bytes(forward)
        count = sum(engine_layer_elements(b, s, h, a, dropout=dropout > 0, **shape).values()) * 8
        assert measured == count, f"{name}, t={WORLD}, dropout {dropout}: meter {measured} B, count {count} B"
        without_masks = sum(engine_layer_elements(b, s, h, a, dropout=False, **shape).values()) * 8
        assert (measured == without_masks) == (dropout == 0), f"{name}: the masks must show in the meter"
