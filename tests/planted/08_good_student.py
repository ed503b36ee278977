"""A correct answer to exercise 08, written apart from the package's."""
from minidist.recompute import dropout_counters
from minidist.tensor import Tensor, no_grad


def checkpoint_forward(fn, inputs):
    counters = dropout_counters(inputs)
    with no_grad():
        out = fn(*inputs)
    return out, counters


def checkpoint_backward(fn, inputs, counters, grad):
    now = [(rng, rng.calls) for rng, _ in counters]
    for rng, start in counters:
        rng.calls = start
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]
