"""Planted bug: the rerun does not rewind the DropoutRNG, so it draws the masks that come
after the forward's (the counter is put back afterwards): the gradients are wrong."""
from minidist.tensor import Tensor


def checkpoint_backward(fn, inputs, counters, grad):
    now = [(rng, rng.calls) for rng, _ in counters]
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]
