"""checkpoint_backward that clears every parameter's gradient before its rerun ("start
clean"): right with one micro-batch, but it wipes what earlier micro-batches accumulated."""
from minidist.recompute import checkpoint_forward  # noqa: F401  (the package's: 8.1 PASSes)
from minidist.tensor import Tensor

EXPECT = {"8.1": None, "8.2": "which your checkpoint_backward wiped"}
RANKS = 1


def checkpoint_backward(fn, inputs, counters, grad):
    for p in fn.parameters():
        p.grad = None                      # wipes the earlier micro-batches' gradients
    now = [(rng, rng.calls) for rng, _ in counters]
    for rng, start in counters:
        rng.calls = start
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]
