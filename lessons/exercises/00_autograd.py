"""Exercise 00: write the backward passes of four ops.

Each function below gets the arrays the op saved in its forward and the gradient of
the loss with respect to the op's output (`grad`), and returns the gradient(s) with
respect to its input(s): plain NumPy arrays of the inputs' dtype. The package's own
versions live in minidist/ops.py (matmul) and minidist/fused.py (the other three)
under the same names; the engine calls them from the Functions MatMul, LayerNorm,
CrossEntropy and GELU. Replace each `raise` with your
code, then grade your file:

    python -m minidist.grade lessons/exercises/00_autograd.py

The grader compares your gradients with central differences of the forward,
(f(x + h) - f(x - h)) / 2h, and tells you the first element that is off. It also checks
that no input changed: the engine still holds the arrays it hands you, so `x *= 0` or
writing into `probs` is a FAIL even when the returned gradient is right. It calls each
function several times, in float64 and in float32: a float32 input must give float32
gradients (a NumPy float64 scalar such as np.sqrt(2 / np.pi) widens a float32 array;
math.sqrt's Python float does not), and every call must return new arrays (a buffer kept
between calls would rewrite the gradient an earlier layer handed to the engine). When a
function passes, the grader puts it into the engine and runs lesson 00's own gradient
check on a tiny GPT with it. Hints: write the shapes down first; a gradient has the shape
of what it is the gradient of.
"""
import numpy as np  # noqa: F401  (you will want it)


def matmul_backward(a, b, grad):
    """Gradients of out = a @ b.

    a: (..., M, K), b: (..., K, N), grad = dL/d out: (..., M, N); the leading (batch)
    dims of a and b broadcast against each other as in np.matmul, and b may be a plain
    (K, N) matrix shared by every batch element.

        grad_a = grad @ b^T        (..., M, K)
        grad_b = a^T @ grad        (..., K, N)

    where ^T swaps the last two axes. If an input was broadcast along a batch dim (or has
    fewer dims), sum its gradient over those dims so it comes back in the input's shape.
    Returns (grad_a, grad_b).
    """
    raise NotImplementedError("exercise 0.1: matmul_backward")


def layer_norm_backward(xhat, rstd, weight, grad):
    """Gradients of layer norm over the last axis, from what its forward saved.

    Forward: mean and variance over the last axis (C channels),
        xhat = (x - mean) * rstd,  rstd = 1 / sqrt(var + eps),  y = xhat * weight + bias.
    xhat, grad: (..., C); rstd: (..., 1); weight: (C,).

        g           = grad * weight
        grad_x      = rstd * (g - mean(g) - xhat * mean(g * xhat))   (means over the last axis)
        grad_weight = sum of grad * xhat over every axis but the last   (C,)
        grad_bias   = sum of grad over every axis but the last          (C,)

    Returns (grad_x, grad_weight, grad_bias).
    """
    raise NotImplementedError("exercise 0.2: layer_norm_backward")


def softmax_cross_entropy_backward(probs, targets, grad):
    """Gradient of the mean cross-entropy with respect to the logits.

    Forward: probs = softmax(logits) over the last axis, loss = mean over the N rows
    of -log(probs[i, targets[i]]). probs: (N, V); targets: (N,) ints; grad: dL/d loss,
    a scalar.

        grad_logits = grad * (probs - one_hot(targets)) / N      (N, V)

    Do not change `probs` in place. Returns grad_logits.
    """
    raise NotImplementedError("exercise 0.3: softmax_cross_entropy_backward")


def gelu_backward(x, grad):
    """Gradient of GELU, tanh approximation, at the input x (any shape).

    Forward: y = 0.5 x (1 + tanh(u)),  u = c (x + 0.044715 x^3),  c = sqrt(2 / pi).

        dy/dx  = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2),  t = tanh(u)
        grad_x = grad * dy/dx

    (Write x*x*x, not x**3: a power of a float32 array is far slower.) Returns grad_x.
    """
    raise NotImplementedError("exercise 0.4: gelu_backward")
