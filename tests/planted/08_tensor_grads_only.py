"""Planted bug: the backward returns gradients for the Tensor inputs only, so its list is
shorter than the inputs and every gradient after a non-Tensor input lands on the wrong one."""
from minidist.tensor import Tensor


def checkpoint_backward(fn, inputs, counters, grad):
    now = [(rng, rng.calls) for rng, _ in counters]
    for rng, start in counters:
        rng.calls = start
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad for x in leaves if isinstance(x, Tensor)]      # the bug: None for the others is missing
