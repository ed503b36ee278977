"""The fused layers: one Function per layer, its backward written in closed form.

Each of these could be built from the primitives in minidist/ops.py, and autograd would
differentiate the pieces. Writing the layer as one node with its backward derived by hand
is better on both counts that matter here:
- fewer temporaries: a graph of pieces saves every intermediate for its backward (GELU's
  x^3, tanh, ...; attention's scores, their exponentials and row sums) and makes a gradient array per
  piece; the fused node saves only what its closed form needs and works in place;
- more accuracy: cross-entropy takes the log-sum-exp of the logits and its gradient is
  probs - one_hot, where the pieces would take the log of a probability that can
  underflow to 0 and divide by it.

The backward math students write in lessons/exercises/00_autograd.py is kept as plain
array functions (`layer_norm_backward`, `softmax_cross_entropy_backward`, `gelu_backward`)
that the Functions call. minidist.ops re-exports every public name of this file, so
`from minidist.ops import gelu` keeps working.
"""
import math

from minidist.backend import xp
from minidist.tensor import Function

# ----------------------------------------------------------------------------- activations, dropout


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

# ----------------------------------------------------------------------------- normalisation, loss, attention


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


def gelu(x): return GELU.apply(x)
def softmax(x, axis=-1): return Softmax.apply(x, axis=axis)


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
