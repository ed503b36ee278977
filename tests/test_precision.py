"""Mixed precision (minidist/precision.py) and the curriculum (minidist/curriculum.py), one
process: the autocast rule op by op, the fp32 masters against a reference written here,
loss scaling exact at powers of two, the scaler's skip and growth, and the schedules."""
import numpy as np
import pytest

from minidist import ops, precision
from minidist.curriculum import Curriculum, lr_at, seqlen_at
from minidist.lessons.precision_checks import bf16_bits
from minidist.model import GPT, GPTConfig
from minidist.precision import GradScaler, MixedPrecision, autocast, round_to
from minidist.tensor import Tensor
from minidist.train import micro_batches, train_step

BF16 = precision.dtype16("bf16")
CFG = GPTConfig(block_size=8, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dtype="float32")


def r16(a, p="bf16"):
    return round_to(np.asarray(a, np.float32), precision.dtype16(p))


def batch(seed=0, B=2, T=8):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (B, T))
    return x, np.roll(x, -1, axis=1)


@pytest.mark.parametrize("p", ["bf16", "fp16"])
def test_linear_follows_the_rule_forward_and_backward(p):
    rng = np.random.default_rng(1)
    x0, w0, b0 = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5, 7), (7, 4), (4,)))
    g0 = rng.standard_normal((3, 5, 4)).astype(np.float32)
    x, w, b = Tensor(x0, requires_grad=True), Tensor(w0, requires_grad=True), Tensor(b0, requires_grad=True)
    with autocast(p):
        y = ops.linear(x, w, b)
    # 16-bit inputs, fp32 products and sum (the bias in the GEMM's epilogue), a 16-bit result
    xr, wr, br = r16(x0, p), r16(w0, p), r16(b0, p)
    want = r16((xr.reshape(-1, 7) @ wr).reshape(3, 5, 4) + br, p)
    assert np.array_equal(y.data, want)
    y.backward(g0)
    gr = r16(g0, p)
    # x is a leaf here, so its gradient stays fp32 as well; the rule rounds activations'
    assert np.array_equal(w.grad, xr.reshape(-1, 7).T @ gr.reshape(-1, 4))
    assert np.array_equal(x.grad, (gr.reshape(-1, 4) @ wr.T).reshape(3, 5, 7))


def test_activation_gradients_leave_a_16_bit_node_rounded():
    rng = np.random.default_rng(2)
    a0, w0 = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
    a = Tensor(a0, requires_grad=True)
    w = Tensor(w0, requires_grad=True)
    with autocast("bf16"):
        h = a * 1.0                      # not a 16-bit op: h is an activation (has a node)
        y = h @ w
    y.backward(np.ones((4, 3), np.float32))
    # the gradient reaching h left the matmul rounded to bf16; "* 1.0" passes it through
    assert np.array_equal(a.grad, r16(np.ones((4, 3), np.float32) @ r16(w0).T))


@pytest.mark.parametrize("p", ["bf16", "fp16"])
def test_the_attention_nodes_two_products_are_16_bit(p):
    """The attention node is on the rule's 16-bit list: q, k, v rounded in, the output (P V)
    rounded out, the softmax between them fp32; the gradients leaving it for q, k, v (all
    activations) rounded too. Against the same node run by hand on 16-bit inputs."""
    from minidist import fused
    rng = np.random.default_rng(5)
    q0, k0, v0, g0 = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(4))
    q, k, v = (Tensor(a * 1.0, requires_grad=True) for a in (q0, k0, v0))
    with autocast(p):
        qa, ka, va = q * 1.0, k * 1.0, v * 1.0        # activations (nodes), as in the model
        y = fused.causal_attention(qa, ka, va)
    want = r16(fused.CausalAttention.forward(_Ctx(), r16(q0, p), r16(k0, p), r16(v0, p)), p)
    assert np.array_equal(y.data, want) and not np.array_equal(want, fused.causal_attention(
        Tensor(q0), Tensor(k0), Tensor(v0)).data)
    y.backward(g0)
    ctx = _Ctx()
    fused.CausalAttention.forward(ctx, r16(q0, p), r16(k0, p), r16(v0, p))
    for got, ref in zip((q.grad, k.grad, v.grad), fused.CausalAttention.backward(ctx, r16(g0, p))):
        assert np.array_equal(got, r16(ref, p))


class _Ctx:
    def save_for_backward(self, *a):
        self.saved = a


def test_softmax_and_layer_norm_stay_fp32():
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((2, 5, 16)).astype(np.float32)
    w, b = np.ones(16, np.float32), np.zeros(16, np.float32)
    plain = (ops.layer_norm(Tensor(x0), Tensor(w), Tensor(b)).data, ops.softmax(Tensor(x0)).data)
    with autocast("bf16"):
        cast = (ops.layer_norm(Tensor(x0), Tensor(w), Tensor(b)).data, ops.softmax(Tensor(x0)).data)
    for p, c in zip(plain, cast):
        assert np.array_equal(p, c)
        assert not np.array_equal(c, r16(c))          # really fp32 values, not 16-bit ones


def test_autocast_off_changes_nothing():
    x, y = batch()
    losses = []
    for p in (None, "fp32"):
        m = GPT(CFG, seed=3)
        if p is None:
            losses.append(m(x, y)[1].item())
        else:
            with autocast(p):
                losses.append(m(x, y)[1].item())
    assert losses[0] == losses[1]


def _reference_masters(steps, lr=1e-2):
    """The bf16 recipe written out by hand: weights = the masters rounded to bf16 by
    bf16_bits (not by ml_dtypes), 16-bit forward and backward, AdamW on the masters."""
    from minidist.nn import Parameter
    from minidist.optim import AdamW
    model = GPT(CFG, seed=5)
    params = model.parameters()
    masters = [Parameter(p.data.astype(np.float32).copy()) for p in params]
    groups = [{"params": [m for m, p in zip(masters, params) if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [m for m, p in zip(masters, params) if p.ndim < 2], "weight_decay": 0.0}]
    opt = AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    to_f32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)   # noqa: E731
    for step in range(steps):
        for p, m in zip(params, masters):
            p.data[...] = to_f32(bf16_bits(m.data)).reshape(p.shape)
            p.grad = None
        x, y = batch(step)
        with autocast("bf16"):
            _, loss = model(x, y)
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.astype(np.float32)
        opt.step()
    return [m.data for m in masters]


def test_bf16_masters_equal_a_reference_that_rounds_by_hand():
    model = GPT(CFG, seed=5)
    opt = MixedPrecision(model.configure_optimizers(0.1, 1e-2), model, "bf16")
    for step in range(3):
        x, y = batch(step)
        with autocast("bf16"):
            train_step(model, opt, micro_batches(x, y, step, 0), 1e-2)
    ref = _reference_masters(3)
    for p, want in zip(model.parameters(), ref):
        assert np.array_equal(opt.master[id(p)].data, want)
    for w16, p in zip(opt.weights16, model.parameters()):
        assert np.array_equal(w16.view(np.uint16), bf16_bits(opt.master[id(p)].data))
        assert np.array_equal(p.data, w16.astype(np.float32))


@pytest.mark.parametrize("p, grad_dtype, per_param", [("bf16", None, 18), ("bf16", "16", 16), ("fp16", None, 16)])
def test_memory_per_parameter_is_measured_from_the_arrays(p, grad_dtype, per_param):
    model = GPT(CFG, seed=1)
    opt = MixedPrecision(model.configure_optimizers(0.1, 1e-3), model, p, grad_dtype)
    x, y = batch()
    with autocast(p):
        train_step(model, opt, micro_batches(x, y, 0, 0), 1e-3)
    n = sum(q.size for q in model.parameters())
    mem = opt.memory()
    assert sum(mem.values()) == per_param * n, mem
    assert mem["weights"] == 2 * n and mem["master"] == 4 * n and mem["optimizer"] == 8 * n


@pytest.mark.parametrize("scale", [2.0 ** 16, 2.0 ** -3, 1.0])
def test_loss_scaling_at_a_power_of_two_gives_the_plain_gradients_exactly(scale):
    x, y = batch()
    grads = []
    for s in (1.0, scale):
        m = GPT(CFG, seed=2)
        (m(x, y)[1] * s).backward()
        grads.append([p.grad for p in m.parameters()])
    unscaled, found = precision.unscale_grads(grads[1], scale)
    assert not found
    for a, b in zip(unscaled, grads[0]):
        assert a.dtype == np.float32 and np.array_equal(a, b)


def test_unscale_finds_inf_and_nan_and_leaves_its_inputs():
    g = [np.ones(3, np.float16), None, np.array([1.0, np.nan], np.float32)]
    keep = [None if a is None else a.copy() for a in g]
    out, found = precision.unscale_grads(g, 4.0)
    assert found and out[1] is None and out[0].dtype == np.float32
    assert all(a is None and b is None or np.array_equal(a, b, equal_nan=True) for a, b in zip(g, keep))
    assert precision.unscale_grads([np.array([np.inf])], 2.0)[1]


def test_scale_halves_on_inf_and_doubles_after_the_interval():
    s, good = 8.0, 0
    trace = []
    for inf in (False, False, True, False, False, False):
        s, good = precision.update_scale(s, good, inf, growth_interval=3)
        trace.append((s, good))
    assert trace == [(8, 1), (8, 2), (4, 0), (4, 1), (4, 2), (8, 0)]


def test_an_overflowed_fp16_step_is_skipped_and_the_scale_backs_off():
    model = GPT(CFG, seed=4)
    opt = MixedPrecision(model.configure_optimizers(0.1, 1e-3), model, "fp16")
    scaler = GradScaler(init_scale=2.0 ** 40, growth_interval=2)
    before = [p.data.copy() for p in model.parameters()]
    x, y = batch()
    with autocast("fp16"), np.errstate(over="ignore", invalid="ignore"):
        train_step(model, opt, micro_batches(x, y, 0, 0), 1e-3, 1.0, scaler=scaler)
        assert scaler.found_inf and scaler.scale == 2.0 ** 39 and scaler.skipped == 1
        assert all(np.array_equal(a, p.data) for a, p in zip(before, model.parameters()))
        for step in range(1, 40):           # it comes down until steps go through, then grows
            train_step(model, opt, micro_batches(x, y, step, 0), 1e-3, 1.0, scaler=scaler)
    went = [s for s, inf in scaler.history if not inf]
    assert went and scaler.skipped == 40 - len(went)      # steps went through once the scale came down
    assert any(s2 > s1 for (s1, _), (s2, _) in zip(scaler.history, scaler.history[1:]))   # and it grew again
    assert all(np.all(np.isfinite(p.data)) for p in model.parameters())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        precision.dtype16("fp8")
    with pytest.raises(ValueError, match="fp32 trains with the optimizer alone"):
        MixedPrecision(GPT(CFG).configure_optimizers(0.1, 1e-3), GPT(CFG), "fp32")
    with pytest.raises(ValueError, match="growth_interval"):
        GradScaler(growth_interval=0)
    with pytest.raises(ValueError, match="start <= end"):
        seqlen_at(0, 0, 64, 10)


def test_curriculum_lengths_are_multiples_of_8_and_ramp_linearly():
    got = [seqlen_at(s, 8, 64, 10) for s in range(12)]
    assert got[0] == 8 and got[10] == got[11] == 64
    assert all(n % 8 == 0 for n in got) and got == sorted(got)
    assert got[5] == 32                               # 8 + 56 x 5/10 = 36, down to a multiple of 8


def test_curriculum_counts_tokens_and_the_plain_run_matches_steps():
    plain = Curriculum(64, 4, total_tokens=64 * 4 * 10, ramp_steps=5, plain=True)
    cur = Curriculum(64, 4, total_tokens=64 * 4 * 10, ramp_steps=5)
    for c in (plain, cur):
        while not c.done():
            c.advance(c.seqlen())
    assert plain.step == 10 and cur.step > 10 and cur.tokens >= plain.tokens


def _lrs(c):
    out = []
    while not c.done():
        out.append(c.lr())
        c.advance(c.seqlen())
    return out


def test_the_plain_runs_schedule_is_get_lr_step_for_step():
    from minidist.train import TrainConfig, get_lr
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=4, max_iters=20)
    plain = Curriculum(64, 4, total_tokens=64 * 4 * 20, ramp_steps=5, plain=True, peak_lr=1.0,
                       min_lr=0.1, warmup_steps=4)
    assert _lrs(plain) == [get_lr(i, cfg) for i in range(20)]


def test_curriculum_warms_up_in_steps_and_decays_over_the_tokens_after_it():
    """DeepSpeed's rule: the warm-up lasts warmup_steps STEPS whatever their length; the cosine
    starts at the peak on the first step after it and runs over the tokens left."""
    total = 64 * 4 * 20
    cur = Curriculum(64, 4, total_tokens=total, ramp_steps=10, start=8, peak_lr=1.0, min_lr=0.1,
                     warmup_steps=4)
    lrs = _lrs(cur)
    assert lrs[:4] == [1.0 * (i + 1) / 5 for i in range(4)]       # in steps, not tokens
    assert lrs[4] == 1.0                                            # the decay starts at its start
    assert cur.warmup_end_tokens == sum(4 * seqlen_at(s, 8, 64, 10) for s in range(4))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] > 0.1
    # half the tokens after the warm-up: halfway down the cosine
    half = cur.warmup_end_tokens + (total - cur.warmup_end_tokens) / 2
    assert lr_at(9, half, 4, cur.warmup_end_tokens, total, 1.0, 0.1) == pytest.approx(0.55, abs=1e-12)
    assert lr_at(9, total, 4, cur.warmup_end_tokens, total, 1.0, 0.1) == 0.1


def test_the_tied_heads_weight_gradient_stays_fp32():
    """x @ wte.T: the weight reaches the matmul through a Transpose node; its gradient is a
    weight's (fp32 from the GEMM), not an activation's (16 bits)."""
    rng = np.random.default_rng(4)
    x0, w0 = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((7, 6)).astype(np.float32)
    g0 = rng.standard_normal((5, 7)).astype(np.float32)
    x = Tensor(x0, requires_grad=True)
    w = Tensor(w0, requires_grad=True)
    with autocast("bf16"):
        y = x @ w.T
    y.backward(g0)
    want = (r16(x0).T @ r16(g0)).T                   # fp32 from the GEMM, not rounded
    assert np.array_equal(w.grad, want) and not np.array_equal(w.grad, r16(w.grad))


def test_hysteresis_halves_the_scale_only_at_the_hth_overflow_since_it_grew():
    """Megatron's DynamicGradScaler (hysteresis 2): every overflow skips its step; the first
    keeps the scale, the second (and each after it) halves it; growth resets the count."""
    s = GradScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=1.0)
    scales = []
    for inf in (True, False, True, True, True, True, False, False, False, True, True):
        s.found_inf = inf
        s.update()
        scales.append(s.scale)
    assert scales == [8, 8, 4, 2, 1, 1, 1, 1, 2, 2, 1]               # min_scale 1 holds; growth resets
    assert s.skipped == 7 and [f for _, f in s.history].count(True) == 7
    plain = GradScaler(init_scale=8.0, growth_interval=3)             # PyTorch's: no hysteresis
    plain.found_inf = True
    plain.update()
    assert plain.scale == 4.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bf16_in_float_arithmetic_equals_ml_dtypes(dtype):
    """The device's bf16 (CuPy has none): rounding on the float bits, the same values as
    ml_dtypes' cast, and store16 / load16 its 2-byte bit patterns (run here on host arrays;
    the strict double runs the same code on its own)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(20_000) * 10.0 ** rng.integers(-44, 39, 20_000)
    tie = np.float64(np.float32(1 + 2 ** -8)) + 2 ** -30        # float32 would round it onto a tie
    with np.errstate(over="ignore"):              # 1e300 and the like: inf in float32
        a = np.concatenate([a, [tie, -tie, 1 + 2 ** -8, 1 + 3 * 2 ** -8, np.inf, -np.inf, 0.0, -0.0,
                                1e300, 1e-300, np.nan]]).astype(dtype)
        want = a.astype(BF16).astype(dtype)
    got = precision.round_bf16(a)
    assert got.dtype == dtype
    assert np.array_equal(got, want, equal_nan=True), np.flatnonzero(got != want)[:5]
    with np.errstate(over="ignore"):
        f = a.astype(np.float32)
    ok = np.isfinite(f)
    bits = (precision.round_bf16(f).view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(bits[ok], bf16_bits(f[ok]))
    stored = (precision.round_bf16(f[ok]).view(np.uint32) >> 16).astype(np.uint16)
    back = (stored.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(back, f[ok].astype(BF16).astype(np.float32))
