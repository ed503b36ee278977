"""checkpoint_backward whose fresh leaves do not require grad (Tensor(x.data)): the
parameters get their gradients, the block's input gets none, and nothing reaches the
layers before it."""
from minidist.tensor import Tensor

EXPECT = {"8.2": "returned None as the gradient of input 0, a Tensor that requires grad"}
RANKS = 1


def checkpoint_backward(fn, inputs, counters, grad):
    now = [(rng, rng.calls) for rng, _ in counters]
    for rng, start in counters:
        rng.calls = start
    leaves = [Tensor(x.data) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]
