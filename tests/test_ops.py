"""Every op's gradient against central differences in float64; float32 stays float32."""
import numpy as np
import pytest

from minidist import ops
from minidist.grader.checks.ex00_autograd import central_difference
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor


def assert_close(name, got, expected, rtol, atol):
    """The tests' own comparison (not the grader's): every element within atol + rtol |expected|."""
    assert got is not None, f"{name} is None"
    got = np.asarray(got)
    assert got.shape == expected.shape, f"{name}: shape {got.shape}, expected {expected.shape}"
    bad = ~np.isclose(got, expected, rtol=rtol, atol=atol)        # a NaN is never close
    assert not bad.any(), (f"{name}: at {np.argwhere(bad)[0].tolist()} got {got[bad][0]!r}, "
                           f"expected {expected[bad][0]!r}")


def gradcheck(f, *arrays, seed=0):
    """Engine gradients of L = sum(f(*inputs) * G) against central differences, per input."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = f(*tensors)
    G = np.random.default_rng(seed).standard_normal(out.shape)
    out.backward(G)

    def loss():
        return float((f(*[Tensor(a) for a in arrays]).data * G).sum())
    for i, (a, t) in enumerate(zip(arrays, tensors)):
        assert_close(f"gradient of input {i} (shape {a.shape})", t.grad, central_difference(loss, a), rtol=1e-5, atol=1e-7)


rng = np.random.default_rng(0)
R = rng.standard_normal

BINARY = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3))]


@pytest.mark.parametrize("sa,sb", BINARY)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_elementwise_broadcasting(op, sa, sb):
    b = R(sb)
    if op == "div":
        b = np.sign(b) * (np.abs(b) + 0.5)           # keep away from zero
    gradcheck(getattr(ops, op), R(sa), b)


def test_operators_and_scalars():
    gradcheck(lambda a, b: (2.0 - a) * b / 3.0 + (-a) @ b.T @ a, R((3, 4)), R((3, 4)))


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                   ((2, 1, 3, 4), (3, 4, 2)), ((3, 4), (2, 4, 5))])
def test_matmul(sa, sb):
    gradcheck(ops.matmul, R(sa), R(sb))


@pytest.mark.parametrize("sx", [(3, 4), (2, 3, 4)])
def test_linear(sx):
    gradcheck(ops.linear, R(sx), R((4, 5)), R(5))
    gradcheck(ops.linear, R(sx), R((4, 5)))


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (1, True), (-1, False), ((0, 2), True)])
def test_sum_mean(axis, keepdims):
    gradcheck(lambda a: ops.sum(a, axis, keepdims), R((2, 3, 4)))
    gradcheck(lambda a: a.mean(axis, keepdims), R((2, 3, 4)))


def test_reshape_transpose_getitem():
    gradcheck(lambda a: a.reshape(4, 6).transpose(0, 1), R((2, 3, 4)))
    gradcheck(lambda a: a.T, R((2, 3, 4)))
    gradcheck(lambda a: a[1:, ::2], R((3, 4)))
    gradcheck(lambda a: a[:, [0, 2, 0]], R((3, 4)))      # repeated index: gradients add up


def test_split_concat():
    gradcheck(lambda a: ops.concat([p * (i + 1) for i, p in enumerate(ops.split(a, 2, axis=1))], axis=1), R((3, 5)))
    gradcheck(lambda a, b: ops.concat([a, b], axis=0), R((2, 3)), R((4, 3)))
    q, k, v = ops.split(Tensor(R((2, 9)), requires_grad=True), 3, axis=-1)
    assert q.shape == k.shape == v.shape == (2, 3)


def test_split_with_unused_piece():
    a = Tensor(R((2, 6)), requires_grad=True)
    x, _ = ops.split(a, 3, axis=1)
    x.sum().backward()
    np.testing.assert_array_equal(a.grad, np.concatenate([np.ones((2, 3)), np.zeros((2, 3))], axis=1))


def test_embedding():
    idx = np.array([[1, 3, 1], [0, 3, 3]])
    gradcheck(lambda w: ops.embedding(idx, w), R((5, 4)))


def test_activations():
    gradcheck(ops.gelu, R((3, 5)) * 3)
    gradcheck(lambda x: ops.softmax(x, axis=-1), R((2, 3, 5)))
    gradcheck(lambda x: ops.softmax(x, axis=0), R((4, 3)))


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 5)])
def test_layer_norm(shape):
    gradcheck(ops.layer_norm, R(shape) * 2 + 1, R(shape[-1]), R(shape[-1]))
    gradcheck(ops.layer_norm, R(shape), R(shape[-1]))


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 7)])
def test_cross_entropy(shape):
    t = rng.integers(0, shape[-1], shape[:-1])
    gradcheck(lambda x: ops.cross_entropy(x, t), R(shape) * 2)
    t2 = t.copy().reshape(-1)
    t2[1] = -100
    gradcheck(lambda x: ops.cross_entropy(x, t2.reshape(t.shape), ignore_index=-100), R(shape))


def test_cross_entropy_value():
    x = R((4, 3))
    t = np.array([0, 2, 1, 1])
    logp = x - np.log(np.exp(x).sum(1, keepdims=True))
    assert np.isclose(ops.cross_entropy(Tensor(x), t).item(), -logp[np.arange(4), t].mean())


def test_dropout():
    gradcheck(lambda x: ops.dropout(x, 0.3, DropoutRNG(0, 0, range(3))), R((3, 4, 5)))


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_causal_attention(p):
    shape = (2, 2, 5, 3)                                  # (B, nh, T, hs)
    gradcheck(lambda q, k, v: ops.causal_attention(q, k, v, p, DropoutRNG(1, 0, range(2))), R(shape), R(shape), R(shape))


def test_causal_attention_matches_naive():
    q, k, v = R((1, 2, 4, 3)), R((1, 2, 4, 3)), R((1, 2, 4, 3))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(3) + np.triu(np.full((4, 4), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ops.causal_attention(Tensor(q), Tensor(k), Tensor(v)).data, p @ v, rtol=1e-12)


def test_float32_stays_float32():
    f = lambda a: np.asarray(a, np.float32)   # noqa: E731
    x = Tensor(f(R((2, 4, 8))), requires_grad=True)
    w = Tensor(f(R((8, 8))), requires_grad=True)
    b = Tensor(f(R(8)), requires_grad=True)
    h = ops.gelu(ops.layer_norm(x @ w + 1.5, b * 2.0, b) / 3.0)
    q = h.reshape(2, 4, 2, 4).transpose(1, 2)
    y = ops.causal_attention(q, q, q, 0.1, DropoutRNG(0, 0, [0, 1]))
    y = ops.softmax(ops.dropout(y, 0.1, DropoutRNG(0, 0, [0, 1])), axis=-1)
    loss = ops.cross_entropy(y, np.zeros((2, 2, 4), dtype=np.int64)) * 0.5 - 1
    assert loss.dtype == np.float32
    loss.backward()
    for t in (x, w, b):
        assert t.grad.dtype == np.float32, t.grad.dtype


@pytest.mark.parametrize("sa,sb", [((4,), (4, 3)), ((3, 4), (4,)), ((4,), (4,)),
                                   ((2, 3, 4), (4,)), ((4,), (2, 4, 3))])
def test_matmul_with_a_one_dimensional_operand(sa, sb):
    """NumPy's rule: a 1-D left operand is a row, a 1-D right operand a column."""
    a, b = R(sa), R(sb)
    out = ops.matmul(Tensor(a), Tensor(b))
    assert out.shape == (a @ b).shape
    gradcheck(ops.matmul, a, b)


def test_matmul_of_a_scalar_is_refused_in_forward():
    with pytest.raises(ValueError, match="at least 1 dimension"):
        ops.matmul(Tensor(np.float64(2.0)), Tensor(R((3,))))
