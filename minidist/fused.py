"""The fused layers: one Function per layer, its backward written in closed form. Over 400
lines but one idea: each fused layer (GELU in its two forms, softmax, dropout, layer norm,
cross-entropy, causal attention) beside its hand-derived backward, and the erf that exact
GELU needs.

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

GELU comes in two forms: GPT-2's tanh approximation (GELU, the default) and the exact
x Phi(x) (GELUErf, `gelu(x, "erf")`, which PyTorch's nn.GELU() and so nanoGPT compute),
with erf written here because NumPy has none.
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


# GELU's exact form, x Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2, as PyTorch's nn.GELU()
# (approximate="none") and so nanoGPT compute it. NumPy has no erf; these are W. J. Cody's
# rational Chebyshev approximations ("Rational Chebyshev approximations for the error
# function", Math. Comp. 23 (1969) 631-637; the coefficients of his CALERF, netlib specfun),
# good to float64 rounding: one form for |y| <= 0.5, one for 0.5 < |y| <= 4, one beyond.
_ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
          3.20937758913846947e03, 1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
          2.84423683343917062e03)
_ERFC_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
           2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
           2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_ERFC_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
           1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
           3.43936767414372164e03, 1.23033935480374942e03)
_ERFC_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
           1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_ERFC_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1,
           6.05183413124413191e-2, 2.33520497626869185e-3)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erf_small(y):
    """erf(y) for |y| <= 0.5: y P(y^2) / Q(y^2)."""
    s = y * y
    num, den = _ERF_A[4] * s, s
    for a, b in zip(_ERF_A[:3], _ERF_B[:3]):
        num = (num + a) * s
        den = (den + b) * s
    return y * (num + _ERF_A[3]) / (den + _ERF_B[3])


def _erfc_positive(y):
    """erfc(y) for y > 0.5: exp(-y^2) R(y), R rational in y up to 4, in 1/y^2 beyond."""
    mid = y <= 4.0
    r = xp.empty_like(y)
    m = y[mid]
    num, den = _ERFC_C[8] * m, m
    for c, d in zip(_ERFC_C[:7], _ERFC_D[:7]):
        num = (num + c) * m
        den = (den + d) * m
    r[mid] = (num + _ERFC_C[7]) / (den + _ERFC_D[7])
    far = y[~mid]
    s = 1.0 / (far * far)
    num, den = _ERFC_P[5] * s, s
    for p, q in zip(_ERFC_P[:4], _ERFC_Q[:4]):
        num = (num + p) * s
        den = (den + q) * s
    r[~mid] = (_INV_SQRT_PI - s * (num + _ERFC_P[4]) / (den + _ERFC_Q[4])) / far
    # exp(-y^2) as exp(-h^2) exp(-(y - h)(y + h)), h = y rounded down to 1/16: y^2 is not
    # exact in floating point, and its rounding error would be multiplied by y^2
    h = xp.trunc(y * 16.0) / 16.0
    return xp.exp(-h * h) * xp.exp(-(y - h) * (y + h)) * r


def _widened(x):
    """(x as an array to compute on, the dtype to return): integers as float64; 16-bit floats
    in float32, rounded back after (the rational forms overflow float16's range)."""
    x = xp.asarray(x)
    if x.dtype.kind in "iub":
        return x.astype(xp.float64), xp.float64
    if x.dtype.itemsize < 4:
        return x.astype(xp.float32), x.dtype
    return x, x.dtype


def erfc(x):
    """The complementary error function 1 - erf(x) of an array, elementwise, accurate where
    it is tiny too (x up to about 26.5 in float64, where it underflows)."""
    x, dtype = _widened(x)
    y = xp.abs(x)
    out = xp.empty_like(x)
    small = y <= 0.5
    out[small] = 1.0 - _erf_small(x[small])
    big = ~small
    r = _erfc_positive(y[big])
    out[big] = xp.where(x[big] < 0, 2.0 - r, r)
    return out.astype(dtype, copy=False)


def erf(x):
    """The error function (2 / sqrt pi) int_0^x exp(-t^2) dt of an array, elementwise."""
    x, dtype = _widened(x)
    y = xp.abs(x)
    out = xp.empty_like(x)
    small = y <= 0.5
    out[small] = _erf_small(x[small])
    big = ~small
    r = 1.0 - _erfc_positive(y[big])
    out[big] = xp.where(x[big] < 0, -r, r)
    return out.astype(dtype, copy=False)


def normal_cdf(x):
    """Phi(x), the standard normal's distribution function: erfc(-x / sqrt 2) / 2 (erfc,
    not 1 + erf: far below 0 Phi is tiny and 1 + erf would lose all its digits)."""
    return 0.5 * erfc(x * -_INV_SQRT_2)


def gelu_erf_backward(x, grad):
    """Gradient of GELU's exact form y = x Phi(x): dy/dx = Phi(x) + x phi(x),
    phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the standard normal's density."""
    d = x * x
    d *= -0.5
    xp.exp(d, out=d)
    d *= _INV_SQRT_2PI
    d *= x
    d += normal_cdf(x)
    d *= grad
    return d


class GELUErf(Function):
    """GELU as x Phi(x) exactly (PyTorch's nn.GELU(), nanoGPT's): `gelu(x, "erf")`."""
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = normal_cdf(x)
        y *= x
        return y

    @staticmethod
    def backward(ctx, grad):
        return gelu_erf_backward(ctx.saved[0], grad)


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


GELU_FORMS = ("tanh", "erf")


def gelu(x, form="tanh"):
    """GELU: form "tanh" is GPT-2's approximation (GELU below), "erf" the exact x Phi(x)
    (GELUErf: PyTorch's nn.GELU() default, which nanoGPT uses). They differ by up to
    about 5e-4 at |x| near 2."""
    if form == "tanh":
        return GELU.apply(x)
    if form == "erf":
        return GELUErf.apply(x)
    raise ValueError(f"gelu form must be one of {', '.join(GELU_FORMS)}, not {form!r}")


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
