"""Blockwise attention (minidist/attention.py) against the plain one, and its pieces.

    python -m pytest -q tests/test_attention.py

The plain attention (fused.CausalAttention) is the reference: in float64 the blockwise
attention's output and its gradients of q, k and v must equal it to 1e-12 per tensor
(max|a - b| / max|b|), for sequence lengths that are and are not multiples of the tile,
tiles of one position and tiles longer than the sequence, with attention dropout (the
plain attention then draws the positional mask whole, through PositionalMaskRNG). The
same holds for queries and keys at scattered global positions (a context-parallel
rank's zigzag chunks), for two disjoint key sets merged by log-sum-exp, and for a whole
GPT built with attention="blockwise". The activation meter drops the (T, T) terms
exactly as plan/memory.py counts, and the tiles computed are the causal triangle's.
"""
import dataclasses

import numpy as np
import pytest

from minidist import fused, recompute
from minidist.attention import (STATS, AttentionDropout, PositionalMaskRNG, attention_partial,
                                attention_partial_backward, blockwise_attention, merge_partials)
from minidist.model import GPT, GPTConfig, generate_greedy
from minidist.parallel.tp_formulas import measured_saved_bytes
from minidist.parallel.tp_model import TensorParallelGPT
from minidist.plan.memory import engine_layer_elements, recompute_peak_elements
from minidist.rng import DropoutRNG
from minidist.tensor import MEMORY, Tensor

TOL = 1e-12
B, NH, HS = 2, 3, 4

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")   # no nan or inf on the way


def rel(a, b):
    """max|a - b| / max|b| (0 when both are 0)."""
    a, b = np.asarray(a), np.asarray(b)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale else float(np.abs(a).max())


def qkv(T, seed=0, nh=NH):
    g = np.random.default_rng(seed)
    return [g.standard_normal((B, nh, T, HS)) for _ in range(3)]


def run(attend, arrays, grad):
    """Output and (dq, dk, dv) of attend(q, k, v) on fresh leaves, backward from grad."""
    leaves = [Tensor(a, requires_grad=True) for a in arrays]
    y = attend(*leaves)
    y.backward(grad)
    return y.data, [t.grad for t in leaves]


def assert_close(got, want, what):
    for name, a, b in zip(("output", "dq", "dk", "dv"), [got[0], *got[1]], [want[0], *want[1]]):
        r = rel(a, b)
        assert r <= TOL, f"{what}: {name} differs from the plain attention's by {r:.1e} (at most {TOL})"

# ----------------------------------------------------------------------------- blockwise == plain


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("T,block", [(16, 4), (13, 4), (7, 1), (9, 16), (5, 5), (1, 3)])
def test_blockwise_equals_plain(T, block, dropout):
    arrays, grad = qkv(T), np.random.default_rng(9).standard_normal((B, NH, T, HS))
    want = run(lambda q, k, v: fused.causal_attention(q, k, v, dropout, PositionalMaskRNG(DropoutRNG(4, 2, [5, 8]))),
               arrays, grad)
    got = run(lambda q, k, v: blockwise_attention(q, k, v, dropout, DropoutRNG(4, 2, [5, 8]), block=block),
              arrays, grad)
    assert_close(got, want, f"T={T}, block={block}, dropout={dropout}")


def zigzag(T, chunks, mine):
    """Positions of chunks `mine` of `chunks` equal chunks of range(T) (array_split's)."""
    parts = np.array_split(np.arange(T), chunks)
    return np.concatenate([parts[c] for c in mine])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("block", [1, 3, 64])
def test_scattered_positions_equal_the_whole_sequence(block, dropout):
    """Queries at a zigzag rank's positions (chunks 1 and 6 of 8) against every key in a
    shuffled order: the rows of the plain attention over the whole sequence, and its
    gradients when only those rows receive one."""
    T = 19
    q_pos = zigzag(T, 8, [1, 6])
    k_pos = np.random.default_rng(3).permutation(T)
    (q, k, v), g = qkv(T), np.random.default_rng(9).standard_normal((B, NH, T, HS))
    g_rows = np.zeros_like(g)
    g_rows[:, :, q_pos] = g[:, :, q_pos]
    y, (dq, dk, dv) = run(lambda q, k, v: fused.causal_attention(q, k, v, dropout,
                                                                   PositionalMaskRNG(DropoutRNG(1, 0, [0, 1]))),
                          (q, k, v), g_rows)
    want = (y[:, :, q_pos], [dq[:, :, q_pos], dk[:, :, k_pos], dv[:, :, k_pos]])
    got = run(lambda q, k, v: blockwise_attention(q, k, v, dropout, DropoutRNG(1, 0, [0, 1]), block=block,
                                                  q_pos=q_pos, k_pos=k_pos),
              (q[:, :, q_pos], k[:, :, k_pos], v[:, :, k_pos]), g[:, :, q_pos])
    assert_close(got, want, f"zigzag queries, shuffled keys, block={block}, dropout={dropout}")

# ----------------------------------------------------------------------------- partial results


def dense_lse(q, k, q_pos, k_pos):
    """The log-sum-exp of the scaled, masked scores, straight from its definition."""
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    s = np.where(k_pos[None, :] <= q_pos[:, None], s, -np.inf)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s).sum(axis=-1))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("block", [2, 5])
def test_two_key_sets_merged_equal_all_keys(block, dropout):
    """Keys split into two disjoint sets (one of them later than the first queries: those
    rows see nothing there, lse = -inf): the merged forward is the whole one, and the
    backward parts (dq summed, dk and dv each set's) are the whole backward."""
    T = 11
    q_pos = zigzag(T, 4, [0, 3])
    k_pos = np.arange(T)
    first, second = zigzag(T, 4, [0, 2]), zigzag(T, 4, [1, 3])
    q, k, v = qkv(T, seed=2)
    q = q[:, :, q_pos]
    do = np.random.default_rng(5).standard_normal(q.shape)

    def drop():
        return AttentionDropout(DropoutRNG(0, 1, [2, 3]), dropout) if dropout else None

    o, lse = attention_partial(q, k, v, q_pos, k_pos, block, drop())
    assert rel(lse, dense_lse(q, k, q_pos, k_pos)) <= TOL
    o1, lse1 = attention_partial(q, k[:, :, first], v[:, :, first], q_pos, first, block, drop())
    o2, lse2 = attention_partial(q, k[:, :, second], v[:, :, second], q_pos, second, block, drop())
    assert np.isneginf(lse2[:, :, :3]).all() and (o2[:, :, :3] == 0).all(), "rows that see no key here"
    om, lsem = merge_partials(o1, lse1, o2, lse2)
    assert rel(om, o) <= TOL and rel(lsem, lse) <= TOL, "merged partials differ from all keys at once"

    dq, dk, dv = attention_partial_backward(q, k, v, q_pos, k_pos, o, lse, do, block, drop())
    dq1, dk1, dv1 = attention_partial_backward(q, k[:, :, first], v[:, :, first], q_pos, first, o, lse, do,
                                               block, drop())
    dq2, dk2, dv2 = attention_partial_backward(q, k[:, :, second], v[:, :, second], q_pos, second, o, lse, do,
                                               block, drop())
    assert rel(dq1 + dq2, dq) <= TOL, "dq: the parts of the two key sets must sum to the whole"
    assert rel(dk1, dk[:, :, first]) <= TOL and rel(dk2, dk[:, :, second]) <= TOL
    assert rel(dv1, dv[:, :, first]) <= TOL and rel(dv2, dv[:, :, second]) <= TOL


def test_merge_with_rows_that_saw_no_key():
    g = np.random.default_rng(0)
    o1, o2 = g.standard_normal((1, 1, 3, 2)), g.standard_normal((1, 1, 3, 2))
    lse1, lse2 = np.array([[[-np.inf, 0.5, -np.inf]]]), np.array([[[1.5, -np.inf, -np.inf]]])
    o1[0, 0, [0, 2]] = 0
    o2[0, 0, [1, 2]] = 0
    o, lse = merge_partials(o1, lse1, o2, lse2)
    np.testing.assert_array_equal(lse[0, 0], [1.5, 0.5, -np.inf])
    np.testing.assert_array_equal(o[0, 0, 0], o2[0, 0, 0])
    np.testing.assert_array_equal(o[0, 0, 1], o1[0, 0, 1])
    np.testing.assert_array_equal(o[0, 0, 2], [0, 0])
    a, la = merge_partials(o1[..., 1:2, :], lse1[..., 1:2], o1[..., 1:2, :], lse1[..., 1:2])
    assert rel(la, lse1[..., 1:2] + np.log(2)) <= TOL and rel(a, o1[..., 1:2, :]) <= TOL

# ----------------------------------------------------------------------------- dropout by position


def test_the_mask_does_not_depend_on_tiling_heads_or_dtype():
    T, p, nh = 12, 0.25, 4
    rng = DropoutRNG(3, 7, [10, 11])
    drop = AttentionDropout(rng, p)
    assert rng.calls == 1 and drop.k == 0, "one AttentionDropout advances the counter by exactly one"
    whole = drop.keep(np.arange(nh), np.arange(T), np.arange(T), np.float64)
    assert whole.shape == (2, nh, T, T) and set(np.unique(whole)) == {0.0, 1 / (1 - p)}
    tiles = np.block([[drop.keep(np.arange(nh), np.arange(i, min(i + 5, T)), np.arange(j, min(j + 5, T)),
                                 np.float64) for j in range(0, T, 5)] for i in range(0, T, 5)])
    np.testing.assert_array_equal(tiles, whole, err_msg="tiles of the mask must be the whole mask's tiles")
    two = AttentionDropout(DropoutRNG(3, 7, [10, 11]), p, head0=2).keep(np.arange(2), np.arange(T),
                                                                        np.arange(T), np.float64)
    np.testing.assert_array_equal(two, whole[:, 2:4], err_msg="head0 = 2 must give heads 2 and 3's mask")
    one = AttentionDropout(DropoutRNG(3, 7, [11]), p).keep(np.arange(nh), np.arange(T), np.arange(T), np.float32)
    assert one.dtype == np.float32
    np.testing.assert_array_equal(one[0] != 0, whole[1] != 0, err_msg="float32 must keep what float64 keeps")
    later = AttentionDropout(rng, p).keep(np.arange(nh), np.arange(T), np.arange(T), np.float64)
    assert not np.array_equal(later, whole), "the next call (k = 1) must draw another mask"


def test_kept_fraction_is_one_minus_p():
    p, n = 0.3, 256
    m = AttentionDropout(DropoutRNG(0, 0, range(4)), p).keep(np.arange(4), np.arange(n), np.arange(n), np.float64)
    kept, size = int((m != 0).sum()), m.size
    sd = np.sqrt(size * p * (1 - p))
    assert abs(kept - size * (1 - p)) <= 6 * sd, f"kept {kept} of {size}, expected {size * (1 - p):.0f}"


@pytest.mark.parametrize("block", [2, 64])
def test_a_slice_of_heads_is_the_whole_attention_sliced(block):
    """Tensor parallelism's view: heads 1..2 of 3 with head0 = 1 give those heads' output
    and gradients of the whole attention, dropout included."""
    T = 9
    arrays, grad = qkv(T, seed=4), np.random.default_rng(1).standard_normal((B, NH, T, HS))
    y, grads = run(lambda q, k, v: blockwise_attention(q, k, v, 0.3, DropoutRNG(0, 0, [0, 1]), block=block),
                   arrays, grad)
    got = run(lambda q, k, v: blockwise_attention(q, k, v, 0.3, DropoutRNG(0, 0, [0, 1]), block=block, head0=1),
              [a[:, 1:] for a in arrays], grad[:, 1:])
    assert_close(got, (y[:, 1:], [g[:, 1:] for g in grads]), f"heads 1..2, block={block}")

# ----------------------------------------------------------------------------- the GPT


TINY = dict(block_size=12, vocab_size=31, n_layer=2, n_head=4, n_embd=16, dtype="float64")


class PlainPositional:
    """A core running the plain attention with the positional dropout mask."""

    def __call__(self, q, k, v, dropout_p, rng, head0):
        return fused.causal_attention(q, k, v, dropout_p, PositionalMaskRNG(rng, head0) if dropout_p else None)


def loss_and_grads(model, x, y, rng=None):
    _, loss = model(x, y, rng=rng)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, rng.calls if rng else None


def assert_same_training(a, b, what):
    (la, ga, ca), (lb, gb, cb) = a, b
    assert abs(la - lb) <= TOL * abs(lb), f"{what}: loss {la!r} against {lb!r}"
    for n in gb:
        assert rel(ga[n], gb[n]) <= TOL, f"{what}: gradient of {n} differs by {rel(ga[n], gb[n]):.1e}"
    assert ca == cb, f"{what}: the forward took {ca} dropout calls, the reference {cb}"


def batch(T=11, seed=0):
    g = np.random.default_rng(seed)
    return g.integers(0, 31, (3, T)), g.integers(0, 31, (3, T))


@pytest.mark.parametrize("block", [1, 4, 64])
def test_gpt_blockwise_equals_plain(block):
    x, y = batch()
    plain = loss_and_grads(GPT(GPTConfig(**TINY), seed=1), x, y)
    blockwise = GPT(GPTConfig(**TINY, attention="blockwise", attn_block=block), seed=1)
    assert_same_training(loss_and_grads(blockwise, x, y), plain, f"GPT, block={block}")


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_gpt_blockwise_with_dropout_equals_plain_with_the_positional_mask(recompute):
    """The plain GPT's own masks come from another generator; given the positional mask
    (a core around fused.causal_attention) it must train exactly as the blockwise GPT,
    every other dropout mask included (each core takes one call of the rng)."""
    x, y = batch(seed=1)
    cfg = GPTConfig(**TINY, dropout=0.2)
    plain = GPT(cfg, seed=1)
    for blk in plain.transformer.h:
        blk.attn.core = PlainPositional()
    want = loss_and_grads(plain, x, y, DropoutRNG(0, 5, range(3)))
    model = GPT(dataclasses.replace(cfg, attention="blockwise", attn_block=4), seed=1).set_recompute(recompute)
    assert_same_training(loss_and_grads(model, x, y, DropoutRNG(0, 5, range(3))), want,
                         f"GPT with dropout, recompute {recompute}")


def test_a_one_rank_tensor_parallel_gpt_keeps_the_core():
    from mpi4py import MPI
    x, y = batch(seed=2)
    cfg = GPTConfig(**TINY, dropout=0.2, attention="blockwise", attn_block=4)
    tp = TensorParallelGPT(GPT(cfg, seed=1), MPI.COMM_SELF)
    assert all(b.attn.core is not None for b in tp.transformer.h), "TensorParallelGPT dropped the core"
    assert_same_training(loss_and_grads(tp, x, y, DropoutRNG(0, 0, range(3))),
                         loss_and_grads(GPT(cfg, seed=1), x, y, DropoutRNG(0, 0, range(3))), "TP at t = 1")


def test_generation_is_unchanged():
    cfg = GPTConfig(**TINY)
    prompt = batch(T=3)[0]
    want, _ = generate_greedy(GPT(cfg, seed=1), prompt, 6)
    got, _ = generate_greedy(GPT(dataclasses.replace(cfg, attention="blockwise", attn_block=2), seed=1), prompt, 6)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad,message", [(dict(attention="flash"), "attention must be one of plain, blockwise"),
                                         (dict(attn_block=0), "attn_block"), (dict(attn_block=2.5), "attn_block"),
                                         (dict(attn_block="64"), "attn_block")])
def test_bad_attention_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**TINY, **bad))

# ----------------------------------------------------------------------------- memory and work


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_meter_drops_the_square_terms_as_counted(dropout):
    """One layer's forward: the meter reads plan/memory.py's engine count for each core,
    and the blockwise one keeps b*s*h + a*s*b numbers (o, lse) in place of the plain
    one's a*s^2*b probabilities (and as many mask entries with dropout)."""
    b, s, h, a = 3, TINY["block_size"], TINY["n_embd"], TINY["n_head"]
    x = np.random.default_rng(0).standard_normal((b, s, h))
    read = {}
    for attention in ("plain", "blockwise"):
        cfg = GPTConfig(**TINY, dropout=dropout, attention=attention, attn_block=5)
        layer = GPT(cfg, seed=0).transformer.h[0]
        MEMORY.reset_peak()
        base = MEMORY.live_bytes
        rng = DropoutRNG(0, 0, range(b)) if dropout else None
        read[attention] = measured_saved_bytes(lambda: layer(Tensor(x), rng))
        assert MEMORY.peak_bytes - base == read[attention], f"{attention}: the forward's peak is its end"
        count = sum(engine_layer_elements(b, s, h, a, dropout=dropout > 0, attention=attention).values()) * 8
        assert read[attention] == count, f"{attention}, dropout {dropout}: meter {read[attention]} B, count {count} B"
    squares = (2 if dropout else 1) * a * s * s * b
    assert read["plain"] - read["blockwise"] == (squares - b * s * h - a * s * b) * 8


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_peak_over_forward_and_backward_equals_the_count(policy):
    """With the blockwise core, selective recomputation checkpoints nothing (the core
    keeps nothing of size s^2): its peak is none's; full keeps the block inputs."""
    cfg = GPTConfig(**TINY, dropout=0.1, attention="blockwise", attn_block=5)
    model = GPT(cfg, seed=1).set_recompute(policy)
    b, g = 2, np.random.default_rng(0)
    x = Tensor(g.standard_normal((b, cfg.block_size, cfg.n_embd)), requires_grad=True)
    MEMORY.reset_peak()
    base = MEMORY.live_bytes
    out = recompute.run_blocks(model.recompute, model.transformer.h, x.reshape(x.shape),
                               DropoutRNG(0, 0, range(b)))
    out.backward(g.standard_normal(out.shape))
    assert MEMORY.live_bytes == base
    count = recompute_peak_elements(policy, cfg.n_layer, b, cfg.block_size, cfg.n_embd, cfg.n_head,
                                    attention="blockwise") * 8
    assert MEMORY.peak_bytes - base == count, f"{policy}: meter {MEMORY.peak_bytes - base} B, count {count} B"


@pytest.mark.parametrize("n,block", [(1, 4), (3, 4), (4, 2)])
def test_causal_tiles_computed_are_the_triangle(n, block):
    T = n * block
    arrays, grad = qkv(T), np.ones((B, NH, T, HS))
    STATS.reset()
    run(lambda q, k, v: blockwise_attention(q, k, v, block=block), arrays, grad)
    assert STATS.tiles_forward == n * (n + 1) // 2, f"{n} x {n} tiles: computed {STATS.tiles_forward}"
    assert STATS.tiles_backward == STATS.tiles_forward and STATS.tiles == 2 * STATS.tiles_forward
    assert STATS.scores_forward == B * NH * T * (T + 1) // 2, "unmasked scores: the causal triangle"
    STATS.reset()
    attention_partial(*arrays, np.full(T, T), np.arange(T), block)     # every key visible: no tile skipped
    assert STATS.tiles_forward == n * n and STATS.scores_forward == B * NH * T * T


def test_a_one_rank_tensor_parallel_gpt_keeps_the_models_gelu():
    from mpi4py import MPI
    x, y = batch(seed=3)
    cfg = GPTConfig(**TINY, gelu="erf")
    tp = TensorParallelGPT(GPT(cfg, seed=1), MPI.COMM_SELF)
    assert_same_training(loss_and_grads(tp, x, y, DropoutRNG(0, 0, range(3))),
                         loss_and_grads(GPT(cfg, seed=1), x, y, DropoutRNG(0, 0, range(3))), "TP erf GELU")
