"""checkpoint_backward that notes the counters and puts them back, but rewinds each rng
to 0 for the rerun rather than to the counter saved in `counters` by the forward."""
from minidist.tensor import Tensor

EXPECT = {"8.2": "not to 0 and not left where it is"}
RANKS = 1


def checkpoint_backward(fn, inputs, counters, grad):
    now = [(rng, rng.calls) for rng, _ in counters]
    for rng, _ in counters:
        rng.calls = 0
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]
