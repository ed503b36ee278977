"""The engine: backward from any tensor, accumulation, no_grad, hooks, the memory meter."""
import sys

import numpy as np
import pytest

from minidist import ops
from minidist.tensor import MEMORY, Tensor, backward_step_callback, is_grad_enabled, no_grad


def test_scalar_backward():
    x = Tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data)


def test_backward_with_explicit_grad_from_non_scalar():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    y = x * 3.0
    g = np.full((2, 3), 0.5)
    y.backward(g)
    np.testing.assert_allclose(x.grad, 1.5 * np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="one-element"):
        (x * 2.0).backward()


def test_inputs_get_gradients_not_only_parameters():
    inp = Tensor(np.ones((2, 2)), requires_grad=True)     # e.g. a pipeline stage's input
    w = Tensor(np.full((2, 2), 2.0), requires_grad=True)
    (inp @ w).sum().backward()
    np.testing.assert_allclose(inp.grad, np.full((2, 2), 4.0))


def test_gradients_accumulate_across_backward_calls():
    w = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (w * 2.0).sum().backward()
    (w * 3.0).sum().backward()
    np.testing.assert_allclose(w.grad, [5.0, 5.0])


def test_shared_gradient_arrays_are_not_aliased():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    (a + b).sum().backward()                               # add hands the same array to both
    a.grad *= 10
    np.testing.assert_allclose(b.grad, np.ones(3))


def test_a_tensor_used_twice_sums_both_paths():
    x = Tensor(np.array([2.0]), requires_grad=True)
    y = x * x
    (y + y * x).sum().backward()                          # x^2 + x^3 -> 2x + 3x^2 = 16
    np.testing.assert_allclose(x.grad, [16.0])


def test_no_grad_records_nothing():
    x = Tensor(np.ones(3), requires_grad=True)
    with no_grad():
        assert not is_grad_enabled()
        y = x * 2.0
    assert is_grad_enabled()
    assert not y.requires_grad
    with pytest.raises(RuntimeError):
        y.sum().backward()


def test_second_backward_through_a_freed_graph_raises():
    x = Tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError):
        y.backward()


def test_grad_ready_hook_fires_once_when_complete():
    rng = np.random.default_rng(0)
    w1 = Tensor(rng.standard_normal((4, 4)), requires_grad=True)
    w2 = Tensor(rng.standard_normal((4, 4)), requires_grad=True)
    x = Tensor(rng.standard_normal((3, 4)))
    seen = {}

    def hook(t):
        assert id(t) not in seen, "hook fired twice"
        seen[id(t)] = t.grad.copy()
    w1.register_grad_ready_hook(hook)
    w2.register_grad_ready_hook(hook)
    h = ops.gelu(x @ w1) @ w2
    out = (h @ w1 + h @ w2).sum()                          # w1, w2 each used twice, far apart
    out.backward()
    assert set(seen) == {id(w1), id(w2)}
    np.testing.assert_array_equal(seen[id(w1)], w1.grad)   # the value at fire time is final
    np.testing.assert_array_equal(seen[id(w2)], w2.grad)


def test_backward_step_callback_runs_between_ops():
    x = Tensor(np.ones(3), requires_grad=True)
    y = ((x * 2.0) * 3.0).sum()
    calls = []
    with backward_step_callback(lambda: calls.append(1)):
        y.backward()
    assert len(calls) == 3                                 # mul, mul, sum
    (x * 2.0).sum().backward()                             # no longer active
    assert len(calls) == 3


def test_memory_meter_counts_saved_activations():
    w = Tensor(np.ones((64, 64), np.float32), requires_grad=True)
    x = Tensor(np.ones((8, 64), np.float32))
    MEMORY.reset_peak()
    start = MEMORY.live_bytes
    h = ops.gelu(x @ w)                                    # saves x (2 KB) and h (2 KB); w is a parameter
    loss = (h * h).sum()
    assert MEMORY.live_bytes - start == 8 * 64 * 4 * 3     # x, gelu's input, h once for h * h
    loss.backward()
    assert MEMORY.peak_bytes - start >= 8 * 64 * 4 * 3
    assert MEMORY.live_bytes == start


def test_memory_is_released_when_a_graph_is_dropped():
    start = MEMORY.live_bytes
    x = Tensor(np.ones((10, 10)), requires_grad=True)
    y = ops.gelu(x * 2.0)                                  # gelu saves its (non-parameter) input
    assert MEMORY.live_bytes > start
    del y
    assert MEMORY.live_bytes == start


def test_python_scalars_do_not_upcast():
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    y = (2.5 * x + 1) / 3 - 0.5
    assert y.dtype == np.float32


def test_backward_through_a_freed_graph_is_refused_before_any_grad_changes():
    """A second loss that shares a freed part of the graph: a clear error, no partial writes."""
    w = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    v = Tensor(np.array([3.0, 4.0]), requires_grad=True)
    h = w * w                                              # shared by both losses
    first = h.sum()
    second = (h * v).sum()                                 # v's gradient comes before h's node
    first.backward()                                       # frees h's saved arrays
    before = w.grad.copy()
    with pytest.raises(RuntimeError, match="already ran.*Mul node.*no .grad was changed"):
        second.backward()
    assert v.grad is None, "v.grad was written before the error"
    np.testing.assert_array_equal(w.grad, before)


def test_requires_grad_on_an_integer_tensor_is_refused():
    with pytest.raises(TypeError, match="floating-point"):
        Tensor(np.arange(3), requires_grad=True)
    t = Tensor(np.arange(3))
    with pytest.raises(TypeError, match="floating-point"):
        t.requires_grad = True
    assert not t.requires_grad
    Tensor(np.arange(3.0), requires_grad=True)             # floats are fine
    Tensor(np.arange(3, dtype=np.float32), requires_grad=True)


def test_a_float_scalar_does_not_truncate_an_integer_tensor():
    y = Tensor(np.array([1, 2, 3])) * 0.5
    np.testing.assert_array_equal(y.data, [0.5, 1.0, 1.5])


@pytest.mark.parametrize("leaf_output", [False, True])
def test_the_array_passed_to_backward_never_becomes_a_grad(leaf_output):
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    out = x if leaf_output else x + Tensor(np.zeros((2, 3)))   # Add hands grad straight through
    G = np.full((2, 3), 0.5)
    out.backward(G)
    assert x.grad is not G and not np.shares_memory(x.grad, G)
    G *= 100                                                # the caller reuses its buffer
    np.testing.assert_array_equal(x.grad, np.full((2, 3), 0.5))
    x.grad *= 3                                             # and the engine's copy is its own
    np.testing.assert_array_equal(G, np.full((2, 3), 50.0))


def test_grad_ready_hook_handle_removes_the_hook():
    w = Tensor(np.ones(3), requires_grad=True)
    calls = []
    h1 = w.register_grad_ready_hook(lambda t: calls.append("a"))
    h2 = w.register_grad_ready_hook(lambda t: calls.append("b"))
    (w * 2.0).sum().backward()
    assert calls == ["a", "b"]
    h1.remove()
    h1.remove()                                             # removing twice is harmless
    (w * 2.0).sum().backward()
    assert calls == ["a", "b", "b"]
    h2.remove()
    (w * 2.0).sum().backward()
    assert calls == ["a", "b", "b"]
    assert w._hooks is None                                 # no hooks left: no bookkeeping in backward


def test_removing_one_of_two_registrations_of_the_same_function_keeps_the_other():
    w = Tensor(np.ones(3), requires_grad=True)
    calls = []
    fn = lambda t: calls.append(1)                          # noqa: E731
    h = w.register_grad_ready_hook(fn)
    w.register_grad_ready_hook(fn)
    h.remove()
    (w * 2.0).sum().backward()
    assert calls == [1]


def test_dropping_a_graph_runs_no_python_code():
    """Python swallows an exception raised in a finaliser, so a Ctrl-C that landed in a
    `__del__` was lost; the meter settles a dropped graph's bytes without one."""
    start = MEMORY.live_bytes
    x = Tensor(np.ones((10, 10)), requires_grad=True)
    y = ops.gelu(ops.gelu(x * 2.0) @ x).sum()             # several nodes hold saved arrays
    assert MEMORY.live_bytes > start
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_qualname) if event == "call" else None)
    try:
        del y
    finally:
        sys.setprofile(None)
    assert calls == [], f"dropping the graph ran {calls}"
    assert MEMORY.live_bytes == start
