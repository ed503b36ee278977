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


def test_raw_grads_are_the_gradients_before_clipping():
    cfg = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dtype="float64")
    model = GPT(cfg, seed=2)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    x, y = DATA.get_batch("train", 4, 0)
    raw = {}
    _, norm = train_step(model, opt, micro_batches(x, y, 0, 2), 1e-3, grad_clip=1e-3, raw_grads=raw)
    assert list(raw) == [n for n, _ in model.named_parameters()]
    raw_norm = np.sqrt(sum(float(np.vdot(g, g)) for g in raw.values()))
    assert abs(raw_norm - norm) <= 1e-12 * norm, "raw_grads must be what clipping saw"
    clipped = np.sqrt(sum(float(np.vdot(p.grad, p.grad)) for p in model.parameters()))
    assert norm > 1e-2 and abs(clipped - 1e-3) < 1e-8, "the step itself still clips"
    assert all(g is not p.grad for g, p in zip(raw.values(), model.parameters()))


def collect(dtype, accum, optimizer="adamw", clip=1.0, steps=3):
    """The lessons' comparison path on one process: train_and_collect with k micro-batches."""
    from types import SimpleNamespace

    from minidist import equivalence
    from minidist.optim import SGD
    cfg = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dropout=0.1, dtype=dtype)
    model = GPT(cfg, seed=4)
    opt = (SGD(model.parameters(), lr=1e-2) if optimizer == "sgd"
           else model.configure_optimizers(0.1, 1e-3, (0.9, 0.95)))
    tc = TrainConfig(batch_size=8, max_iters=steps, learning_rate=1e-3, warmup_iters=1, grad_clip=clip)
    args = SimpleNamespace(steps=steps, batch_size=8, seed=9)
    losses, state, _ = equivalence.train_and_collect(model, opt, DATA, args, tc, micro=accum)
    state["loss"] = np.array(losses)
    return state


@pytest.mark.parametrize("optimizer,clip", [("adamw", 1e-3), ("sgd", 0.0)])
def test_accumulation_matches_in_the_lessons_comparison(optimizer, clip):
    from minidist import equivalence
    one, two = collect("float64", 1, optimizer, clip), collect("float64", 2, optimizer, clip)
    for kind, rel, _, worst in equivalence.compare_by_kind(two, one):
        assert rel <= 1e-10, f"{kind}: max_rel_diff {rel:.2e} in {worst}"
    assert equivalence.compare(two, one)[0] <= 1e-10


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_planted_micro_batch_loss_not_scaled_by_1_over_k_is_caught(dtype, monkeypatch):
    """Forget the 1/k and two micro-batches give twice the gradient. Clipping (here it
    really clips) and AdamW nearly hide it from the weights; the raw gradients cannot."""
    from minidist import train as train_module
    from minidist import equivalence
    one = collect(dtype, 1, clip=1e-3)
    monkeypatch.setattr(train_module, "micro_batch_scale", lambda k: 1.0)
    two = collect(dtype, 2, clip=1e-3)
    tol = equivalence.TOLERANCE[dtype]
    kinds = {kind: rel for kind, rel, _, _ in equivalence.compare_by_kind(two, one)}
    assert kinds["raw gradients"] > tol and equivalence.compare(two, one)[0] > tol, kinds
    first = [k for k in one if k.startswith("grad:") and k.endswith("@step0")]
    rel0 = equivalence.compare({k: two[k] for k in first}, {k: one[k] for k in first})[0]
    assert abs(rel0 - 1.0) <= 1e-3, f"step 0's gradients should be exactly twice as large: {rel0}"
    factor, residual = equivalence.gradient_factor(two, one)        # what lesson 02 tells the student
    assert abs(factor - 2.0) <= 1e-5 and residual <= 1e-5, (factor, residual)
    assert equivalence.gradient_factor(collect(dtype, 1, clip=1e-3), one) == (1.0, 0.0)
