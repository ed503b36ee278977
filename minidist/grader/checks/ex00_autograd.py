"""Checks for lessons/exercises/00_autograd.py: four backward functions.

Each check builds inputs from a fixed seed, hands them to the function, and only then
computes the answer: central differences (f(x + h) - f(x - h)) / 2h of the forward in
plain float64 NumPy, element by element. The loss is L = sum(out * G) with a random G,
so the gradient handed to a backward is G. Any correct answer passes; the package's own
answer is graded the same way (tests/test_checks00.py).

What the engine needs of a backward, beyond the right numbers, is checked too:
- no input changes: a backward gets arrays the engine still holds (the saved
  activations, the gradient flowing in), so `x *= 0` or writing into `probs` corrupts
  the rest of the backward pass even when the returned value is right;
- the dtype is kept: each function is called in float64 and in float32 (the lessons
  train in float32), and a float32 input must give float32 gradients, within float32's
  tolerance of the float64 answer;
- every call returns new arrays: each function is called several times, twice with
  inputs of the same shape and dtype, and the results of earlier calls must be unchanged
  afterwards (a buffer kept between calls would rewrite an earlier layer's gradient).

After the unit check passes, the plug-in check (minidist/grader/plugin.py) puts the
function into the engine and runs lesson 00's own gradient check (RUNS below).
"""
import math

import numpy as np

from minidist import ops
from minidist.grader.checks import Exercise
from minidist.grader.plugin import Run

EPS = 1e-6
DTYPES = (np.float64, np.float32)
# (rtol, atol). float64: the central differences' own error is ~1e-9. float32: the package's
# answers are off the float64 answer by at most 7e-7 on these inputs (gradients of size 0.05
# to 6), a margin of 14 below atol; a wrong formula is off by 1e-2 or more.
TOL = {np.dtype(np.float64): (1e-5, 1e-7), np.dtype(np.float32): (1e-4, 1e-5)}


def central_difference(f, x, eps=EPS):
    """d f / d x for a scalar function f of the array x (changed in place, then restored)."""
    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        up = f()
        x[i] = old - eps
        down = f()
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def assert_close(name, got, expected, dtype=np.float64):
    """Raise AssertionError naming the first element of `got` that is off, or a wrong dtype."""
    dtype = np.dtype(dtype)
    if got is None:
        raise AssertionError(f"{name} is None, expected an array of shape {expected.shape}")
    got = np.asarray(getattr(got, "data", got))
    if got.shape != expected.shape:
        raise AssertionError(f"{name} has shape {got.shape}, expected {expected.shape}")
    if got.dtype != dtype:
        raise AssertionError(f"{name} is {got.dtype.name}, expected {dtype.name}: keep the inputs' dtype "
                             f"({dtype.name} in, {dtype.name} out; a NumPy float64 scalar such as "
                             "np.sqrt(2 / np.pi) or a float64 buffer from np.zeros(shape) widens float32)")
    rtol, atol = TOL[dtype]
    bad = ~np.isclose(got, expected, rtol=rtol, atol=atol)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        where = f"[{', '.join(map(str, i))}]" if i else ""
        raise AssertionError(f"{name}{where} is {got[i]:.8g}, expected {expected[i]:.8g} (central difference; "
                             f"{dtype.name}: within rtol {rtol:.0e} + atol {atol:.0e})")


def call_unchanged(fn, name, **inputs):
    """fn(*inputs) on copies; raise AssertionError when it changed any of them in place."""
    copies = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    result = fn(*copies.values())
    for k, v in inputs.items():
        if isinstance(v, np.ndarray) and not np.array_equal(copies[k], v):
            raise AssertionError(f"{name} changed its input `{k}` in place (e.g. `{k} *= ...` or writing "
                                 f"into {k}[...]); the engine still needs it: compute into new arrays")
    return result


def _unpack(result, n, names):
    if not isinstance(result, tuple) or len(result) != n:
        raise AssertionError(f"return a tuple of {n} arrays ({', '.join(names)}), not {type(result).__name__}")
    return result


class Kept:
    """The results of earlier calls, with copies: a later call must not change them."""

    def __init__(self, name):
        self.name, self.kept = name, []

    def add(self, label, arrays):
        self.kept.append((label, [(a, np.array(a, copy=True)) for a in arrays if isinstance(a, np.ndarray)]))

    def unchanged(self, now):
        for label, pairs in self.kept[:-1]:
            if any(not np.array_equal(a, c, equal_nan=True) for a, c in pairs):
                raise AssertionError(f"the result {self.name} returned for {label} changed when it was called again "
                                     f"({now}): return new arrays on every call, not a buffer kept between calls "
                                     "(the engine still holds every gradient a backward returned)")


def _f64(*arrays):
    return [np.array(a, dtype=np.float64) for a in arrays]

# ----------------------------------------------------------------------------- 0.1


MATMUL_SHAPES = {np.float64: [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                              ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (4, 5))],
                 np.float32: [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (4, 5))]}


def check_matmul_backward(fn):
    rng = np.random.default_rng(1)
    kept = Kept("matmul_backward")
    for dtype in DTYPES:
        for sa, sb in MATMUL_SHAPES[dtype]:
            a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
            G = rng.standard_normal(np.matmul(a, b).shape).astype(dtype)
            label = f"a {sa} @ b {sb}, {np.dtype(dtype).name}"
            ga, gb = _unpack(call_unchanged(fn, "matmul_backward", a=a, b=b, grad=G), 2, ("grad_a", "grad_b"))
            kept.add(label, (ga, gb))
            kept.unchanged(label)
            a, b, G = _f64(a, b, G)                           # the answer, only now, in float64
            loss = lambda: float((np.matmul(a, b) * G).sum())   # noqa: E731
            assert_close(f"grad_a ({label})", ga, central_difference(loss, a), dtype)
            assert_close(f"grad_b ({label})", gb, central_difference(loss, b), dtype)

# ----------------------------------------------------------------------------- 0.2


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mu) * rstd
    return xhat * w + b, xhat, rstd


def check_layer_norm_backward(fn):
    rng = np.random.default_rng(2)
    kept = Kept("layer_norm_backward")
    for dtype in DTYPES:
        for shape in [(4, 6), (2, 3, 5), (4, 6)]:
            C = shape[-1]
            x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
            w, b = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
            G = rng.standard_normal(shape).astype(dtype)
            _, xhat, rstd = _layer_norm(x, w, b)                 # what the forward saved, in its dtype
            label = f"x of shape {shape}, {np.dtype(dtype).name}"
            gx, gw, gb = _unpack(call_unchanged(fn, "layer_norm_backward", xhat=xhat, rstd=rstd, weight=w, grad=G),
                                 3, ("grad_x", "grad_weight", "grad_bias"))
            kept.add(label, (gx, gw, gb))
            kept.unchanged(label)
            x, w, b, G = _f64(x, w, b, G)
            loss = lambda: float((_layer_norm(x, w, b)[0] * G).sum())   # noqa: E731
            assert_close(f"grad_x ({label})", gx, central_difference(loss, x), dtype)
            assert_close(f"grad_weight ({label})", gw, central_difference(loss, w), dtype)
            assert_close(f"grad_bias ({label})", gb, central_difference(loss, b), dtype)

# ----------------------------------------------------------------------------- 0.3


def _cross_entropy(logits, targets):
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(targets)), targets].mean(), np.exp(logp)


def check_softmax_cross_entropy_backward(fn):
    rng = np.random.default_rng(3)
    kept = Kept("softmax_cross_entropy_backward")
    for dtype in DTYPES:
        for n, v, g in [(5, 7, 1.0), (8, 3, 0.37), (5, 7, 2.5)]:
            logits = (rng.standard_normal((n, v)) * 3).astype(dtype)
            targets = rng.integers(0, v, n)
            _, probs = _cross_entropy(logits, targets)
            grad = np.array(g, dtype=dtype)                      # as the engine hands it: a 0-d array
            label = f"{n} rows, {v} classes, grad {g}, {np.dtype(dtype).name}"
            got = call_unchanged(fn, "softmax_cross_entropy_backward", probs=probs.astype(dtype), targets=targets,
                                 grad=grad)
            kept.add(label, (got,))
            kept.unchanged(label)
            logits, = _f64(logits)
            loss = lambda: g * float(_cross_entropy(logits, targets)[0])   # noqa: E731
            assert_close(f"grad_logits ({label})", got, central_difference(loss, logits), dtype)

# ----------------------------------------------------------------------------- 0.4


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def check_gelu_backward(fn):
    rng = np.random.default_rng(4)
    kept = Kept("gelu_backward")
    for dtype in DTYPES:
        for shape in [(7,), (3, 4, 5), (7,)]:
            x = (rng.standard_normal(shape) * 3).astype(dtype)
            G = rng.standard_normal(shape).astype(dtype)
            label = f"x of shape {shape}, {np.dtype(dtype).name}"
            got = call_unchanged(fn, "gelu_backward", x=x, grad=G)
            kept.add(label, (got,))
            kept.unchanged(label)
            x, G = _f64(x, G)
            loss = lambda: float((_gelu(x) * G).sum())   # noqa: E731
            assert_close(f"grad_x ({label})", got, central_difference(loss, x), dtype)


# Lesson 00 on one process at a tiny shape: its verdict is its gradient check, the engine's
# backward() against central differences on a tiny GPT, which reaches all four functions
# (MatMul and Linear call ops.matmul_backward, LayerNorm, CrossEntropy and GELU the others
# in minidist.fused, each through its module's global name, where the plug-in puts yours).
# That check runs in float64 whatever --dtype says: central differences in float32 would
# drown a wrong gradient in rounding, so a float32 run would repeat the same verdict.
# float32 is the unit check's part (dtype kept, float32's tolerance).
RUNS = (Run("00_single_process", ("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
                                  "--batch-size", "2", "--steps", "2", "--sample-tokens", "0",
                                  "--eval-interval", "0", "--peak-tflops", "1"), ranks=1, dtypes=("float64",)),)

EXERCISES = [
    Exercise("0.1", "matmul_backward", ops.matmul_backward, check_matmul_backward, runs=RUNS),
    Exercise("0.2", "layer_norm_backward", ops.layer_norm_backward, check_layer_norm_backward, runs=RUNS),
    Exercise("0.3", "softmax_cross_entropy_backward", ops.softmax_cross_entropy_backward,
             check_softmax_cross_entropy_backward, runs=RUNS),
    Exercise("0.4", "gelu_backward", ops.gelu_backward, check_gelu_backward, runs=RUNS),
]
