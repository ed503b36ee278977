"""The primitive ops of the engine: one Function each, forward and backward side by side.

The recipe never changes: forward computes the output from arrays and saves what the
backward needs; backward turns the output's gradient into one gradient per input.
Here: elementwise arithmetic with broadcasting, matmul and linear, sum, the shape ops
(reshape, transpose, getitem, split, concat) and embedding. The layers whose backward
is fused into one closed form (GELU, softmax, layer norm, cross-entropy, dropout, causal
attention) live in minidist/fused.py and are re-exported here, so `ops.gelu`,
`ops.layer_norm_backward`, ... work as before. `matmul_backward` is the first exercise
of lessons/exercises/00_autograd.py; the other three are in fused.py.

Linear and MatMul also split their backward for zero-bubble pipelines: WEIGHT_INPUTS
names the operands whose gradient may wait, backward_weight computes one of them later
(minidist.tensor.deferred_weight_grads).

Speed notes: float32 stays float32 (python scalars do not upcast under NumPy 2);
matrix products against a 2-D weight run as one big (B*T, C) GEMM.
"""
import itertools
import math

from minidist.backend import xp
from minidist.tensor import Function, Tensor
from minidist.fused import (  # noqa: F401  (re-exported: minidist.ops names every op)
    GELU, GELU_C, GELU_FORMS, CausalAttention, CrossEntropy, Dropout, GELUErf, LayerNorm, Softmax,
    causal_attention, cross_entropy, dropout, erf, erfc, gelu, gelu_backward, gelu_erf_backward,
    layer_norm, layer_norm_backward, normal_cdf, softmax, softmax_cross_entropy_backward)


def unbroadcast(grad, shape):
    """Sum a broadcast gradient back to `shape` (the backward of broadcasting)."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)

# ----------------------------------------------------------------------------- elementwise


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = a.shape, b.shape
        return a + b

    @staticmethod
    def backward(ctx, grad):
        sa, sb = ctx.shapes
        return unbroadcast(grad, sa), unbroadcast(grad, sb)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = a.shape, b.shape
        return a - b

    @staticmethod
    def backward(ctx, grad):
        sa, sb = ctx.shapes
        return unbroadcast(grad, sa), unbroadcast(-grad, sb)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        ga = unbroadcast(grad * b, a.shape) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(grad * a, b.shape) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        ga = unbroadcast(grad / b, a.shape) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-grad * a / (b * b), b.shape) if ctx.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, grad):
        return -grad

# ----------------------------------------------------------------------------- matmul


def _mm(a, b):
    """a @ b, as one 2-D GEMM when b is a plain matrix: (..., K) @ (K, N)."""
    if b.ndim == 2 and a.ndim > 2:
        return (a.reshape(-1, a.shape[-1]) @ b).reshape(a.shape[:-1] + (b.shape[1],))
    return a @ b


def matmul_grad_a(b, grad, a_shape):
    """grad_a of out = a @ b: grad @ b^T, summed back over the batch dims a was broadcast along."""
    return unbroadcast(_mm(grad, b.swapaxes(-1, -2)), a_shape)


def matmul_grad_b(a, grad, b_shape):
    """grad_b of out = a @ b: a^T @ grad, summed back over the batch dims b was broadcast along."""
    if len(b_shape) == 2 and a.ndim > 2:      # weight grad: one (K, B*T) @ (B*T, N) GEMM
        return a.reshape(-1, a.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])
    return unbroadcast(a.swapaxes(-1, -2) @ grad, b_shape)


def matmul_backward(a, b, grad):
    """Gradients of out = a @ b (batch dims broadcast, both at least 2-D).

    grad_a = grad @ b^T, grad_b = a^T @ grad (transposes of the last two axes),
    each summed back over batch dims it was broadcast along.
    """
    return matmul_grad_a(b, grad, a.shape), matmul_grad_b(a, grad, b.shape)


def _as_matrices(a, b, grad):
    """NumPy's 1-D rule made explicit: a 1-D a is a row (1, K), a 1-D b a column (K, 1),
    and grad gets back the axis the product dropped."""
    if b.ndim == 1:
        grad = grad[..., None]                 # (..., M) -> (..., M, 1)
    if a.ndim == 1:
        grad = xp.expand_dims(grad, -2)        # (..., N) -> (..., 1, N)
    return (a[None, :] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b), grad


class MatMul(Function):
    """a @ b with NumPy's rules, 1-D operands included.

    NumPy treats a 1-D `a` as a row (1, K) and a 1-D `b` as a column (K, 1), then drops
    that axis from the result. The backward does the same: it puts the dropped axis
    back into grad, runs the 2-D rule, and returns gradients of the operands' own shapes.
    Split backward (zero bubble): an operand that is a Parameter gets its gradient from
    backward_weight, later (minidist.tensor.deferred_weight_grads).
    """
    WEIGHT_INPUTS = (0, 1)

    @staticmethod
    def forward(ctx, a, b):
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError(f"matmul needs operands of at least 1 dimension, got shapes {a.shape} and "
                             f"{b.shape} (multiply by a scalar with *)")
        ctx.save_for_backward(a, b)
        return _mm(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        need_a, need_b = ctx.needs_input_grad
        a2, b2, grad = _as_matrices(a, b, grad) if min(a.ndim, b.ndim) < 2 else (a, b, grad)
        if need_a and need_b:                # exercise 0.1's function, looked up when it runs
            ga, gb = matmul_backward(a2, b2, grad)
        else:
            ga = matmul_grad_a(b2, grad, a2.shape) if need_a else None
            gb = matmul_grad_b(a2, grad, b2.shape) if need_b else None
        if min(a.ndim, b.ndim) < 2:
            return (None if ga is None else ga.reshape(a.shape)), (None if gb is None else gb.reshape(b.shape))
        return ga, gb

    @staticmethod
    def backward_weight(ctx, grad, i):
        a, b = ctx.saved
        a2, b2, grad = _as_matrices(a, b, grad) if min(a.ndim, b.ndim) < 2 else (a, b, grad)
        g = matmul_grad_a(b2, grad, a2.shape) if i == 0 else matmul_grad_b(a2, grad, b2.shape)
        return g.reshape((a, b)[i].shape) if min(a.ndim, b.ndim) < 2 else g


class Linear(Function):
    """y = x @ W + b in one node: the bias is added in place into the GEMM's output.

    Split backward (zero bubble): B computes grad_x only; W, later, grad_W = x^T grad and
    grad_b = the sum of grad over rows, from the saved x and the kept grad.
    """
    WEIGHT_INPUTS = (1, 2)

    @staticmethod
    def forward(ctx, x, w, b=None):
        ctx.save_for_backward(x, w)
        y = _mm(x, w)
        if b is not None:
            y += b
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved
        needs = ctx.needs_input_grad
        if needs[0] and needs[1]:            # exercise 0.1's function, looked up when it runs
            gx, gw = matmul_backward(x, w, grad)
        else:
            gx = matmul_grad_a(w, grad, x.shape) if needs[0] else None
            gw = matmul_grad_b(x, grad, w.shape) if needs[1] else None
        if len(needs) == 3:
            return gx, gw, (grad.reshape(-1, grad.shape[-1]).sum(axis=0) if needs[2] else None)
        return gx, gw

    @staticmethod
    def backward_weight(ctx, grad, i):
        if i == 2:
            return grad.reshape(-1, grad.shape[-1]).sum(axis=0)
        x, w = ctx.saved
        return matmul_grad_b(x, grad, w.shape)

# ----------------------------------------------------------------------------- shapes


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axis, ctx.keepdims = a.shape, axis, keepdims
        return xp.asarray(a.sum(axis=axis, keepdims=keepdims))

    @staticmethod
    def backward(ctx, grad):
        if ctx.axis is not None and not ctx.keepdims:
            grad = xp.expand_dims(grad, ctx.axis)
        return xp.broadcast_to(grad, ctx.shape)


class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape)


class Transpose(Function):
    @staticmethod
    def forward(ctx, a, dim0, dim1):
        ctx.dims = dim0, dim1
        return a.swapaxes(dim0, dim1)                  # a view, as in PyTorch

    @staticmethod
    def backward(ctx, grad):
        return grad.swapaxes(*ctx.dims)


class GetItem(Function):
    @staticmethod
    def forward(ctx, a, index):
        ctx.shape, ctx.dtype, ctx.index = a.shape, a.dtype, index
        return a[index]

    @staticmethod
    def backward(ctx, grad):
        out = xp.zeros(ctx.shape, ctx.dtype)
        index = ctx.index if isinstance(ctx.index, tuple) else (ctx.index,)
        if all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in index):
            out[ctx.index] = grad                      # basic slicing: each element once
        else:
            xp.add.at(out, ctx.index, grad)            # fancy indexing: repeats add up
        return out


class Split(Function):
    @staticmethod
    def forward(ctx, a, size, axis):
        ctx.axis = axis
        return tuple(xp.split(a, range(size, a.shape[axis], size), axis=axis))

    @staticmethod
    def backward(ctx, grads):
        return xp.concatenate(grads, axis=ctx.axis)


class Concat(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        # where each piece ends: shapes are host numbers, summed on the host
        ctx.axis, ctx.ends = axis, list(itertools.accumulate(a.shape[axis] for a in arrays))[:-1]
        return xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return tuple(xp.split(grad, ctx.ends, axis=ctx.axis))


class Embedding(Function):
    @staticmethod
    def forward(ctx, weight, idx):
        ctx.idx, ctx.shape = idx, weight.shape
        return weight[idx]                              # (*idx.shape, C)

    @staticmethod
    def backward(ctx, grad):
        out = xp.zeros(ctx.shape, grad.dtype)
        xp.add.at(out, ctx.idx.ravel(), grad.reshape(-1, ctx.shape[1]))
        return out

# ----------------------------------------------------------------------------- functional API


def add(a, b): return Add.apply(a, b)
def sub(a, b): return Sub.apply(a, b)
def mul(a, b): return Mul.apply(a, b)
def div(a, b): return Div.apply(a, b)
def neg(a): return Neg.apply(a)
def matmul(a, b): return MatMul.apply(a, b)
def sum(a, axis=None, keepdims=False): return Sum.apply(a, axis=axis, keepdims=keepdims)  # noqa: A001
def reshape(a, shape): return Reshape.apply(a, shape=tuple(shape))
def transpose(a, dim0, dim1): return Transpose.apply(a, dim0=dim0, dim1=dim1)
def getitem(a, index): return GetItem.apply(a, index=index)


def mean(a, axis=None, keepdims=False):
    n = a.size if axis is None else math.prod(a.shape[i] for i in (axis if isinstance(axis, tuple) else (axis,)))
    return mul(sum(a, axis, keepdims), Tensor(xp.full((), 1.0 / n, dtype=a.dtype)))


def linear(x, weight, bias=None):
    """x @ weight + bias, weight of shape (in_features, out_features)."""
    return Linear.apply(x, weight) if bias is None else Linear.apply(x, weight, bias)


def split(a, size, axis=-1):
    """Pieces of `size` along `axis` (the last may be shorter), as torch.split."""
    out = Split.apply(a, size=size, axis=axis % a.ndim)
    return out if isinstance(out, tuple) else (out,)


def concat(tensors, axis=0):
    return Concat.apply(*tensors, axis=axis)


def embedding(idx, weight):
    """Rows of weight (V, C) picked by the int array idx (...,) -> (..., C)."""
    return Embedding.apply(weight, idx=idx)

