"""The training loop's pieces: bit-for-bit determinism, the schedule, accumulation, metrics."""
import numpy as np
import pytest

from minidist import metrics
from minidist.data import Dataset, default_corpus
from minidist.model import GPT, GPTConfig
from minidist.tensor import MEMORY
from minidist.train import TrainConfig, estimate_loss, get_lr, micro_batches, train_step

DATA = Dataset.from_text(default_corpus()[:30_000], block_size=16, seed=3)


def losses_of(dtype, dropout, accum=1, steps=4, seed=5):
    cfg = GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=dropout, dtype=dtype)
    model = GPT(cfg, seed=seed)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    out = []
    for step in range(steps):
        x, y = DATA.get_batch("train", 8, step)
        out.append(train_step(model, opt, micro_batches(x, y, step, seed, accum), 1e-3, 1.0)[0])
    return out, model


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_same_seed_same_losses_bit_for_bit(dtype):
    a, ma = losses_of(dtype, dropout=0.1)
    b, mb = losses_of(dtype, dropout=0.1)
    assert a == b, "two runs from the same seed must agree exactly"
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert np.array_equal(p.data, q.data), n
        assert p.data.dtype == np.dtype(dtype), f"{n} is {p.data.dtype}, expected {dtype}"
    c, _ = losses_of(dtype, dropout=0.1, seed=6)
    assert a != c, "another seed gives another run"


def test_accumulation_gives_the_same_step():
    """Two micro-batches of 4 or one batch of 8: the same gradient, so the same weights."""
    one, m1 = losses_of("float64", dropout=0.1, accum=1)
    two, m2 = losses_of("float64", dropout=0.1, accum=2)
    assert np.allclose(one, two, rtol=1e-12)
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert np.allclose(p.data, q.data, rtol=0, atol=1e-12), n


def test_lr_schedule_warms_up_then_decays_to_min():
    tc = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, max_iters=100)
    lrs = [get_lr(i, tc) for i in range(120)]
    assert lrs[0] < lrs[5] < lrs[9] < 1.0
    assert np.all(np.diff(lrs[10:100]) <= 0), "cosine decay never rises"
    assert abs(lrs[10] - 1.0) < 1e-12 and abs(lrs[55] - 0.55) < 1e-12
    assert lrs[100:] == [0.1] * 20


def test_estimate_loss_is_deterministic_and_leaves_no_graph():
    _, model = losses_of("float32", dropout=0.1, steps=1)
    MEMORY.reset_peak()
    a = estimate_loss(model, DATA, 4, iters=2)
    b = estimate_loss(model, DATA, 4, iters=2)
    assert a == b and set(a) == {"train", "val"}
    assert MEMORY.peak_bytes == 0, "evaluation must not save activations"
    assert model.training


def test_flops_per_token_formula():
    cfg = GPTConfig(block_size=64, n_layer=3, n_head=4, n_embd=32)
    assert metrics.flops_per_token(cfg, 1000) == 6 * 1000 + 12 * 3 * 4 * 8 * 64


def test_memory_by_category_counts_the_arrays_held():
    _, model = losses_of("float32", dropout=0.0, steps=1)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    n = sum(p.data.size for p in model.parameters())
    mem = metrics.memory_by_category(model.parameters(), opt, activations_peak=123)
    assert mem["params"] == mem["grads"] == 4 * n
    assert mem["optimizer"] == 0, "AdamW allocates its moments at the first step"
    assert mem["activations_peak"] == 123


def test_measured_peak_is_positive():
    assert metrics.measure_peak_flops("float32", n=64, seconds=0.01) > 0
