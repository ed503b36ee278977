"""Every op of the engine: one Function each, forward and backward side by side.

The recipe never changes: forward computes the output from arrays and saves what the
backward needs; backward turns the output's gradient into one gradient per input.
The backward math of the ops students write (lessons/exercises/00_autograd.py) lives
in plain array functions, `matmul_backward`, `layer_norm_backward`,
`softmax_cross_entropy_backward`, `gelu_backward`, which the Functions call.

Speed notes: float32 stays float32 (python scalars do not upcast under NumPy 2);
matrix products against a 2-D weight run as one big (B*T, C) GEMM; layer norm, GELU,
softmax + cross-entropy and causal attention are fused with closed-form backwards.
"""
import math

from minidist.backend import xp
from minidist.tensor import Function, Tensor


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


def matmul_backward(a, b, grad):
    """Gradients of out = a @ b (batch dims broadcast, both at least 2-D).

    grad_a = grad @ b^T, grad_b = a^T @ grad (transposes of the last two axes),
    each summed back over batch dims it was broadcast along.
    """
    grad_a = _mm(grad, b.swapaxes(-1, -2))
    if b.ndim == 2 and a.ndim > 2:            # weight grad: one (K, B*T) @ (B*T, N) GEMM
        grad_b = a.reshape(-1, a.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])
    else:
        grad_b = unbroadcast(a.swapaxes(-1, -2) @ grad, b.shape)
    return unbroadcast(grad_a, a.shape), grad_b


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _mm(a, b)

    @staticmethod
    def backward(ctx, grad):
        return matmul_backward(*ctx.saved, grad)


class Linear(Function):
    """y = x @ W + b in one node: the bias is added in place into the GEMM's output."""
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
        gx, gw = matmul_backward(x, w, grad)
        if len(ctx.needs_input_grad) == 3:
            return gx, gw, grad.reshape(-1, grad.shape[-1]).sum(axis=0)
        return gx, gw

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
        ctx.axis, ctx.ends = axis, list(xp.cumsum([a.shape[axis] for a in arrays])[:-1])
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

# ----------------------------------------------------------------------------- activations


GELU_C = math.sqrt(2.0 / math.pi)


def gelu_backward(x, grad):
    """Gradient of GELU's tanh approximation y = 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3).

    dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2), t = tanh(u), c = sqrt(2/pi).
    """
    x2 = x * x
    t = x2 * 0.044715
    t += 1.0
    t *= x
    t *= GELU_C
    xp.tanh(t, out=t)                                   # t = tanh(u)
    x2 *= 3 * 0.044715 * GELU_C
    x2 += GELU_C                                        # du/dx
    d = t * t
    xp.subtract(1.0, d, out=d)
    d *= x
    d *= x2
    t += 1.0
    t += d
    t *= 0.5                                            # dy/dx
    t *= grad
    return t


class GELU(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        u = x * x                                       # h*h*h, never h**3 (slow on float32)
        u *= 0.044715
        u += 1.0
        u *= x
        u *= GELU_C
        xp.tanh(u, out=u)
        u += 1.0
        u *= x
        u *= 0.5
        return u

    @staticmethod
    def backward(ctx, grad):
        return gelu_backward(ctx.saved[0], grad)


class Softmax(Function):
    @staticmethod
    def forward(ctx, x, axis=-1):
        y = x - x.max(axis=axis, keepdims=True)
        xp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        ctx.axis = axis
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        y = ctx.saved[0]
        gy = grad * y
        return gy - y * gy.sum(axis=ctx.axis, keepdims=True)   # y (g - sum(g y))


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p, rng):
        mask = rng.mask(x.shape, p, x.dtype)           # 0 or 1/(1-p), per sample
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.saved[0]

# ----------------------------------------------------------------------------- fused layers


def layer_norm_backward(xhat, rstd, weight, grad):
    """Gradients of y = xhat * weight + bias, xhat = (x - mean(x)) * rstd, over the last axis.

    xhat, grad: (..., C); rstd = 1 / sqrt(var(x) + eps): (..., 1); weight: (C,).
    grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = grad * weight
    (means over the last axis); grad_weight = sum of grad * xhat, grad_bias = sum of grad,
    both over every axis but the last.
    """
    C = xhat.shape[-1]
    grad_weight = (grad * xhat).reshape(-1, C).sum(axis=0)
    grad_bias = grad.reshape(-1, C).sum(axis=0)
    g = grad * weight
    gx = g * xhat
    m2 = gx.mean(axis=-1, keepdims=True)
    g -= g.mean(axis=-1, keepdims=True)
    xp.multiply(xhat, m2, out=gx)
    g -= gx
    g *= rstd
    return g, grad_weight, grad_bias


class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias=None, eps=1e-5):
        xhat = x - x.mean(axis=-1, keepdims=True)             # (..., C)
        var = (xhat * xhat).mean(axis=-1, keepdims=True)       # (..., 1)
        rstd = 1.0 / xp.sqrt(var + eps)
        xhat *= rstd
        ctx.save_for_backward(xhat, rstd, weight)
        y = xhat * weight
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def backward(ctx, grad):
        gx, gw, gb = layer_norm_backward(*ctx.saved, grad)
        return (gx, gw, gb) if len(ctx.needs_input_grad) == 3 else (gx, gw)


def softmax_cross_entropy_backward(probs, targets, grad):
    """Gradient of loss = mean over rows of -log(probs[i, targets[i]]), probs = softmax(logits).

    probs: (N, V); targets: (N,) ints; grad: the loss's gradient (a scalar).
    grad_logits = grad * (probs - one_hot(targets)) / N, shape (N, V).
    """
    n = probs.shape[0]
    out = probs * (grad / n)
    out[xp.arange(n), targets] -= grad / n
    return out


class CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index=None):
        V = logits.shape[-1]
        x, t = logits.reshape(-1, V), targets.reshape(-1)     # (N, V), (N,)
        valid = None if ignore_index is None else (t != ignore_index)
        if valid is not None:
            x, t = x[valid], t[valid]
        probs = x - x.max(axis=1, keepdims=True)
        target_logit = probs[xp.arange(len(t)), t]            # shifted by the max
        xp.exp(probs, out=probs)
        s = probs.sum(axis=1, keepdims=True)
        loss = (xp.log(s[:, 0]) - target_logit).mean() if len(t) else xp.zeros((), logits.dtype)
        probs /= s
        ctx.shape, ctx.valid = logits.shape, valid
        ctx.save_for_backward(probs, t)
        return xp.asarray(loss, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        probs, t = ctx.saved
        g = softmax_cross_entropy_backward(probs, t, grad)
        if ctx.valid is not None:                             # ignored rows get no gradient
            full = xp.zeros((ctx.valid.size, ctx.shape[-1]), g.dtype)
            full[ctx.valid] = g
            g = full
        return g.reshape(ctx.shape)


_CAUSAL = {}


def _causal_bias(T, dtype):
    """(T, T): 0 on and below the diagonal, -inf above (a query sees no later key)."""
    key = (T, xp.dtype(dtype).str)
    if key not in _CAUSAL:
        _CAUSAL[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _CAUSAL[key]


class CausalAttention(Function):
    """softmax(q k^T / sqrt(hs) + causal mask) (dropout) @ v, in one node.

    backward: with P the probabilities and D the dropout mask (all ones without dropout),
    dV = (P*D)^T dY, dP = (dY V^T) * D, dS = P * (dP - sum(dP * P)), dQ = dS K / sqrt(hs),
    dK = dS^T Q / sqrt(hs).
    """
    @staticmethod
    def forward(ctx, q, k, v, dropout_p=0.0, rng=None):
        T, hs = q.shape[-2], q.shape[-1]
        qs = q * (1.0 / math.sqrt(hs))                        # (B, nh, T, hs)
        att = qs @ k.swapaxes(-1, -2)                         # (B, nh, T, T)
        att += _causal_bias(T, att.dtype)
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)
        mask = rng.mask(att.shape, dropout_p, att.dtype) if dropout_p > 0 else None
        y = (att * mask if mask is not None else att) @ v     # (B, nh, T, hs)
        ctx.save_for_backward(qs, k, v, att, mask)
        return y

    @staticmethod
    def backward(ctx, grad):
        qs, k, v, att, mask = ctx.saved
        hs = qs.shape[-1]
        dropped = att * mask if mask is not None else att
        dv = dropped.swapaxes(-1, -2) @ grad                  # (B, nh, T, hs)
        datt = grad @ v.swapaxes(-1, -2)                      # (B, nh, T, T)
        if mask is not None:
            datt *= mask
        datt -= (datt * att).sum(axis=-1, keepdims=True)
        datt *= att                                           # dS (masked entries are 0)
        dq = datt @ k
        dq *= 1.0 / math.sqrt(hs)
        dk = datt.swapaxes(-1, -2) @ qs
        return dq, dk, dv

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
def gelu(x): return GELU.apply(x)
def softmax(x, axis=-1): return Softmax.apply(x, axis=axis)


def mean(a, axis=None, keepdims=False):
    n = a.size if axis is None else math.prod(a.shape[i] for i in (axis if isinstance(axis, tuple) else (axis,)))
    return mul(sum(a, axis, keepdims), Tensor(xp.asarray(1.0 / n, dtype=a.dtype)))


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


def layer_norm(x, weight, bias=None, eps=1e-5):
    return LayerNorm.apply(x, weight, eps=eps) if bias is None else LayerNorm.apply(x, weight, bias, eps=eps)


def cross_entropy(logits, targets, ignore_index=None):
    """Mean over all tokens of -log softmax(logits)[target]; logits (..., V), targets (...)."""
    return CrossEntropy.apply(logits, targets=targets, ignore_index=ignore_index)


def dropout(x, p, rng):
    """Zero each element with probability p and scale the rest by 1/(1-p); rng a DropoutRNG."""
    if p == 0.0:
        return x
    return Dropout.apply(x, p=p, rng=rng)


def causal_attention(q, k, v, dropout_p=0.0, rng=None):
    """Fused causal self-attention on (B, nh, T, hs) queries, keys and values."""
    return CausalAttention.apply(q, k, v, dropout_p=dropout_p, rng=rng)
