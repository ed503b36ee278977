"""Context parallelism without a world: the layout, plan.context's formulas, and the pieces
that run on one rank (cp = 1 equals the GPT, a ring step to oneself).

    python -m pytest -q tests/test_context_parallel_serial.py

The formulas are held to the engine where they can be without MPI: the tiles a rank
computes are counted by running minidist.attention on each pair of chunks it would meet.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.attention import STATS, attention_partial
from minidist.model import GPT, GPTConfig
from minidist.comm import ring_reduce_scatter_v
from minidist.parallel.context_parallel import (ContextParallelAttention, CPError, chunk_bounds_2cp, rank_chunks,
                                                rank_positions, rank_ranges, ring_pass_start)
from minidist.parallel.cp_model import ContextParallelGPT
from minidist.plan import context as C

SIZES = [(s, cp) for cp in range(1, 9) for s in range(2 * cp, 2 * cp + 13)]


@pytest.mark.parametrize("seq,cp", SIZES[::5])
def test_chunks_are_array_split_and_every_position_is_held_once(seq, cp):
    want = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(seq), 2 * cp)]).tolist()
    assert chunk_bounds_2cp(seq, cp) == want
    lengths = np.diff(want)
    assert lengths.max() - lengths.min() <= 1 and list(lengths) == sorted(lengths, reverse=True), \
        "array_split: the first chunks are the longer ones"
    for lb in (True, False):
        held = np.concatenate([rank_positions(seq, cp, r, lb) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(seq)), f"seq {seq} cp {cp} load_balance {lb}"
        for r in range(cp):
            assert len(rank_positions(seq, cp, r, lb)) == C.tokens_of(seq, cp, r, lb)   # two witnesses agree
            assert rank_chunks(r, cp, lb) == C.chunks_of(r, cp, lb)


def test_zigzag_and_naive_chunks():
    assert [rank_chunks(r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_chunks(r, 4, load_balance=False) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_positions(14, 3, 0).tolist() == [0, 1, 2, 12, 13]          # chunks 3,3,2,2,2,2
    assert rank_positions(14, 3, 2).tolist() == [6, 7, 8, 9]
    assert rank_ranges(14, 3, 1) == [(3, 6), (10, 12)]


@pytest.mark.parametrize("variant", C.VARIANTS)
def test_cp_sent_is_the_papers_formula_when_chunks_are_equal(variant):
    for cp in range(1, 9):
        for seq in (2 * cp, 4 * cp, 6 * cp):
            heads = 2 * cp                                # Ulysses: divisible by cp
            want = C.cp_layer_bytes(variant, 3, seq, heads, 5, cp, 8)
            for r in range(cp):
                assert C.cp_sent(variant, 3, seq, heads, 5, cp, r, 8) == want, (variant, cp, seq, r)


def test_the_papers_numbers():
    """Ring and all-gather: 6 (cp-1) b (s/cp) kv hd; Ulysses 4 (h + kv)(cp-1)/cp b (s/cp) hd; GQA."""
    b, s, h, hd, cp, item = 1, 8192, 32, 128, 4, 2
    n = s // cp
    assert C.cp_layer_bytes("ring", b, s, h, hd, cp, item) == 6 * 3 * b * n * h * hd * item
    assert C.cp_layer_bytes("ulysses", b, s, h, hd, cp, item) == 4 * 2 * h * 3 * b * n * hd * item // 4
    assert C.cp_layer_bytes("allgather", b, s, h, hd, cp, item, n_kv_head=8) == 6 * 3 * b * n * 8 * hd * item
    assert C.cp_layer_bytes("ring", b, s, h, hd, 1, item) == 0
    with pytest.raises(ValueError, match="unknown context-parallel variant"):
        C.cp_sent("zigzag", 1, 8, 2, 2, 2, 0, 8)


@pytest.mark.parametrize("seq,cp", [(s, cp) for s, cp in SIZES if cp > 1][::3])
def test_uneven_chunks_bytes_add_up(seq, cp):
    """Over the ranks the ring and the all-gather send 6 (cp-1) s e in all, Ulysses
    4 (h + kv)(cp-1)/cp s: what one rank sends moves with its tokens, the total does not."""
    e = 2 * 4 * 8                                        # b x hd x itemsize, one head
    for lb in (True, False):
        total = {v: sum(C.cp_sent(v, 2, seq, cp, 4, cp, r, 8, lb) for r in range(cp)) for v in C.VARIANTS}
        assert total["ring"] == total["allgather"] == 6 * (cp - 1) * seq * cp * e
        assert total["ulysses"] * cp == 4 * 2 * cp * (cp - 1) * seq * e


def engine_tiles(seq, cp, rank, block, lb):
    """Tiles minidist.attention computes for rank's query chunks against every chunk."""
    g = np.random.default_rng(0)
    STATS.reset()
    for qlo, qhi in rank_ranges(seq, cp, rank, lb):
        for j in range(cp):
            for klo, khi in rank_ranges(seq, cp, j, lb):
                q = g.normal(size=(1, 1, qhi - qlo, 2))
                k = g.normal(size=(1, 1, khi - klo, 2))
                attention_partial(q, k, k, np.arange(qlo, qhi), np.arange(klo, khi), block)
    return STATS.tiles_forward


@pytest.mark.parametrize("seq,cp,block", [(16, 2, 4), (14, 3, 2), (13, 3, 2), (24, 4, 3), (21, 2, 4), (9, 4, 1)])
def test_attention_tiles_equal_the_engines(seq, cp, block):
    for lb in (True, False):
        for r in range(cp):
            assert C.attention_tiles("ring", seq, cp, r, block, lb) == engine_tiles(seq, cp, r, block, lb), \
                (seq, cp, r, block, lb)


def test_load_balance_evens_the_work():
    for cp in (2, 3, 4, 8, 16):
        for block, chunk in ((4, 4), (4, 8), (64, 64)):
            seq = 2 * cp * chunk
            bal = [C.attention_tiles("ring", seq, cp, r, block) for r in range(cp)]
            naive = [C.attention_tiles("ring", seq, cp, r, block, False) for r in range(cp)]
            assert max(bal) - min(bal) <= 1, (cp, bal)
            assert naive[-1] > naive[0] and sum(naive) == sum(bal)
            scores = [C.attention_scores("ring", 1, seq, 1, cp, r) for r in range(cp)]
            contiguous = [C.attention_scores("ring", 1, seq, 1, cp, r, False) for r in range(cp)]
            assert len(set(scores)) == 1 and sum(scores) == seq * (seq + 1) // 2
            n = seq // cp                                  # the (2cp-1):1 imbalance, exactly
            assert contiguous[-1] * (n + 1) == contiguous[0] * ((2 * cp - 1) * n + 1)
    assert C.imbalance([3, 5])[0] == 2


def test_tiles_balance_only_when_every_chunk_spans_as_many_tiles():
    """seq 29, cp 3, tiles of 2: chunks of 5 and 4 tokens span 3 and 2 tiles, and the zigzag's
    tiles differ by far more than one; its score elements stay within the uneven token."""
    bal = [C.attention_tiles("ring", 29, 3, r, 2) for r in range(3)]
    assert bal == [39, 57, 57] == [engine_tiles(29, 3, r, 2, True) for r in range(3)]
    scores = [C.attention_scores("ring", 1, 29, 1, 3, r) for r in range(3)]
    assert scores == [125, 155, 155] and max(scores) - min(scores) <= 29 + 1     # the last token's p + 1
    assert len({C.attention_tiles("ring", 29, 3, r, 5) for r in range(3)}) == 1   # 5 and 4 tokens: one tile each
    assert C.attention_tiles("ring", 6, 1, 0, 2) == engine_tiles(6, 1, 0, 2, True) == 6   # cp 1: one triangle


def test_one_rank_ring_step_and_reduce_scatter():
    comm = MPI.COMM_SELF
    a, got = np.arange(6.0), np.empty(6)
    MPI.Request.Waitall(ring_pass_start(comm, [a], [got], 12000))
    assert got.tolist() == a.tolist()
    x = np.arange(24.0).reshape(1, 2, 3, 4)
    assert np.array_equal(ring_reduce_scatter_v(comm, x, [3], axis=2), x)


@pytest.mark.parametrize("variant", C.VARIANTS)
def test_cp_1_is_the_gpt(variant):
    cfg = dict(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=8, dtype="float64", attention="blockwise",
               attn_block=4)
    x = np.random.default_rng(1).integers(0, 20, (2, 8))
    ref = GPT(GPTConfig(**cfg), seed=1)
    loss_ref = ref(x, np.roll(x, -1, 1))[1]
    loss_ref.backward()
    cp = ContextParallelGPT(GPT(GPTConfig(**cfg), seed=1), MPI.COMM_SELF, variant)
    loss = cp(x, np.roll(x, -1, 1))[1]
    loss.backward()
    assert abs(loss.item() - loss_ref.item()) <= 1e-12
    for (n, p), (_, q) in zip(cp.named_parameters(), ref.named_parameters()):
        assert np.allclose(p.grad, q.grad, rtol=0, atol=1e-13), n


def test_wrapping_changes_the_model_and_a_second_wrap_is_refused():
    """ContextParallelGPT puts its cores into the model it wraps: the model is the CP
    model's from then on (references build a GPT of their own), and a second wrap fails."""
    gpt = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=2, n_head=2, n_embd=8, dtype="float64",
                        attention="blockwise", attn_block=4), seed=1)
    model = ContextParallelGPT(gpt, MPI.COMM_SELF, "ring")
    assert [b.attn.core for b in gpt.transformer.h] == model.cores
    assert all(isinstance(c, ContextParallelAttention) for c in model.cores)
    with pytest.raises(CPError, match="wrapped already"):
        ContextParallelGPT(gpt, MPI.COMM_SELF, "allgather")
