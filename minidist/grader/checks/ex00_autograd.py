"""Checks for lessons/exercises/00_autograd.py: four backward functions.

Each check builds float64 inputs from a fixed seed, computes the forward in plain NumPy
and compares the function's gradients with central differences of that forward
(f(x + h) - f(x - h)) / 2h, element by element. The loss is L = sum(out * G) with a
random G, so the gradient handed to a backward is G. Any correct answer passes; the
package's own answer is graded the same way (tests/test_checks00.py).

Every check also verifies that no input changed: a backward gets arrays the engine still
holds (the saved activations, the gradient flowing in), so `x *= 0` or writing into
`probs` corrupts the rest of the backward pass even when the returned value is right.
"""
import math

import numpy as np

from minidist import ops
from minidist.grader.checks import Exercise

EPS = 1e-6


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


def assert_close(name, got, expected, rtol=1e-5, atol=1e-7):
    """Raise AssertionError naming the first element of `got` that is off."""
    if got is None:
        raise AssertionError(f"{name} is None, expected an array of shape {expected.shape}")
    got = np.asarray(getattr(got, "data", got))
    if got.shape != expected.shape:
        raise AssertionError(f"{name} has shape {got.shape}, expected {expected.shape}")
    bad = ~np.isclose(got, expected, rtol=rtol, atol=atol)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        where = f"[{', '.join(map(str, i))}]" if i else ""
        raise AssertionError(f"{name}{where} is {got[i]:.6g}, expected {expected[i]:.6g} (central difference)")


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

# ----------------------------------------------------------------------------- 0.1


def check_matmul_backward(fn):
    rng = np.random.default_rng(1)
    for sa, sb in [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                   ((2, 1, 3, 4), (5, 4, 2))]:
        a, b = rng.standard_normal(sa), rng.standard_normal(sb)
        G = rng.standard_normal(np.matmul(a, b).shape)
        ga, gb = _unpack(call_unchanged(fn, "matmul_backward", a=a, b=b, grad=G), 2, ("grad_a", "grad_b"))
        loss = lambda: float((np.matmul(a, b) * G).sum())   # noqa: E731
        assert_close(f"grad_a (a {sa} @ b {sb})", ga, central_difference(loss, a))
        assert_close(f"grad_b (a {sa} @ b {sb})", gb, central_difference(loss, b))

# ----------------------------------------------------------------------------- 0.2


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mu) * rstd
    return xhat * w + b, xhat, rstd


def check_layer_norm_backward(fn):
    rng = np.random.default_rng(2)
    for shape in [(4, 6), (2, 3, 5)]:
        C = shape[-1]
        x = rng.standard_normal(shape) * 2 + 0.5
        w, b = rng.standard_normal(C), rng.standard_normal(C)
        G = rng.standard_normal(shape)
        _, xhat, rstd = _layer_norm(x, w, b)
        gx, gw, gb = _unpack(call_unchanged(fn, "layer_norm_backward", xhat=xhat, rstd=rstd, weight=w, grad=G), 3,
                             ("grad_x", "grad_weight", "grad_bias"))
        loss = lambda: float((_layer_norm(x, w, b)[0] * G).sum())   # noqa: E731
        assert_close(f"grad_x (x of shape {shape})", gx, central_difference(loss, x))
        assert_close(f"grad_weight (x of shape {shape})", gw, central_difference(loss, w))
        assert_close(f"grad_bias (x of shape {shape})", gb, central_difference(loss, b))

# ----------------------------------------------------------------------------- 0.3


def _cross_entropy(logits, targets):
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(targets)), targets].mean(), np.exp(logp)


def check_softmax_cross_entropy_backward(fn):
    rng = np.random.default_rng(3)
    for n, v, g in [(5, 7, 1.0), (8, 3, 0.37)]:
        logits = rng.standard_normal((n, v)) * 3
        targets = rng.integers(0, v, n)
        _, probs = _cross_entropy(logits, targets)
        got = call_unchanged(fn, "softmax_cross_entropy_backward", probs=probs, targets=targets, grad=g)
        loss = lambda: g * float(_cross_entropy(logits, targets)[0])   # noqa: E731
        assert_close(f"grad_logits ({n} rows, {v} classes, grad {g})", got, central_difference(loss, logits))

# ----------------------------------------------------------------------------- 0.4


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def check_gelu_backward(fn):
    rng = np.random.default_rng(4)
    for shape in [(7,), (3, 4, 5)]:
        x = rng.standard_normal(shape) * 3
        G = rng.standard_normal(shape)
        got = call_unchanged(fn, "gelu_backward", x=x, grad=G)
        loss = lambda: float((_gelu(x) * G).sum())   # noqa: E731
        assert_close(f"grad_x (x of shape {shape})", got, central_difference(loss, x))


EXERCISES = [
    Exercise("0.1", "matmul_backward", ops.matmul_backward, check_matmul_backward),
    Exercise("0.2", "layer_norm_backward", ops.layer_norm_backward, check_layer_norm_backward),
    Exercise("0.3", "softmax_cross_entropy_backward", ops.softmax_cross_entropy_backward,
             check_softmax_cross_entropy_backward),
    Exercise("0.4", "gelu_backward", ops.gelu_backward, check_gelu_backward),
]
