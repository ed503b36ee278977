"""The key/value cache of the single-process GPT: generation that feeds only the new token
each step must give the logits and the greedy tokens of generation that feeds the whole
prefix every step (float64, to 1e-12 per step).

    python -m pytest -q tests/test_kv_cache.py
"""
import numpy as np
import pytest

from minidist.model import GPT, GPTConfig, KVCache, cached_attention, generate_greedy
from minidist.tensor import Tensor, no_grad
from minidist import ops


def model(dtype="float64", block_size=16, **kw):
    cfg = GPTConfig(block_size=block_size, vocab_size=61, n_layer=2, n_head=4, n_embd=32, dtype=dtype, **kw)
    return GPT(cfg, seed=5)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("prompt,new", [(1, 15), (5, 11), (3, 30)], ids=["to the block", "prompt", "past the block"])
def test_cached_generation_equals_uncached(prompt, new):
    """The same tokens, and each step's logits within 1e-12 of the uncached ones. Past the
    block (3 + 30 > 16) both crop the context: the cached run recomputes from there."""
    m = model()
    idx = np.random.default_rng(0).integers(0, 61, (3, prompt))
    got, got_logits = generate_greedy(m, idx, new, use_cache=True)
    want, want_logits = generate_greedy(m, idx, new, use_cache=False)
    assert len(got_logits) == len(want_logits) == new
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        assert rel(a, b) <= 1e-12, f"step {step}: cached logits differ from uncached by {rel(a, b):.2e}"
    assert np.array_equal(got, want), f"greedy tokens differ:\n{got}\n{want}"
    assert np.array_equal(got[:, :prompt], idx)


def test_the_cache_feeds_one_token_per_step(monkeypatch):
    """After the prompt, every forward sees one position (that is the whole point)."""
    m = model()
    seen = []
    real = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, idx, *a, **kw: seen.append(np.shape(idx)[1]) or
                        real(self, idx, *a, **kw))
    generate_greedy(m, np.zeros((2, 4), np.int64), 6, use_cache=True)
    assert seen == [4, 1, 1, 1, 1, 1], seen
    seen.clear()
    generate_greedy(m, np.zeros((2, 4), np.int64), 3, use_cache=False)
    assert seen == [4, 5, 6], seen


def test_a_stale_cache_is_caught():
    """Positions after the cached ones matter: feeding a token at the wrong position (a
    cache that forgot to advance) changes the logits, so the comparison above can fail."""
    m = model()
    m.eval()
    idx = np.random.default_rng(1).integers(0, 61, (2, 6))
    with no_grad():
        whole = m(idx)[0].data[:, -1]
        cache = m.new_cache()
        m(idx[:, :5], cache=cache)
        right = m(idx[:, 5:], cache=cache)[0].data[:, -1]
        stale = m.new_cache()
        m(idx[:, :5], cache=stale)
        for lk in stale.layers:
            lk.length -= 1                                # token 5 lands on position 4
        wrong = m(idx[:, 5:], cache=stale)[0].data[:, -1]
    assert rel(right, whole) <= 1e-12
    assert rel(wrong, whole) > 1e-3


def test_cached_attention_is_the_fused_attention_from_position_zero():
    g = np.random.default_rng(2)
    q, k, v = (g.standard_normal((2, 3, 7, 4)) for _ in range(3))
    want = ops.causal_attention(Tensor(q), Tensor(k), Tensor(v)).data
    assert np.array_equal(cached_attention(q, k, v, 0), want)
    # the last 2 queries alone, against all 7 keys
    assert np.abs(cached_attention(q[:, :, 5:], k, v, 5) - want[:, :, 5:]).max() <= 1e-15


def test_the_cache_refuses_what_cannot_run():
    m = model()
    with pytest.raises(RuntimeError, match="no_grad"):
        m(np.zeros((1, 2), np.int64), cache=m.new_cache())          # training with a cache
    with no_grad():
        cache = m.new_cache()
        m(np.zeros((1, 16), np.int64), cache=cache)
        with pytest.raises(ValueError, match="longer than block_size"):
            m(np.zeros((1, 1), np.int64), cache=cache)


def test_cache_memory():
    m = model()
    cache = m.new_cache()
    with no_grad():
        m(np.zeros((3, 2), np.int64), cache=cache)
    assert isinstance(cache, KVCache) and cache.length == 2
    assert cache.nbytes() == 2 * 2 * 3 * 16 * 32 * 8          # 2 (k, v) x L x B x block x C x 8 B


def test_float32_tokens_match_too():
    m = model("float32")
    idx = np.random.default_rng(3).integers(0, 61, (2, 3))
    a, la = generate_greedy(m, idx, 12)
    b, lb = generate_greedy(m, idx, 12, use_cache=False)
    assert np.array_equal(a, b)
    assert max(rel(x, y) for x, y in zip(la, lb)) <= 1e-5
