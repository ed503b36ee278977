"""What a Function's forward leaves for its backward, and what that costs in memory.

Every Function's forward gets a `Context`: `ctx.needs_input_grad` says which inputs want
a gradient, `ctx.save_for_backward(*arrays)` keeps the arrays the backward will read
(`ctx.saved`), and anything else the backward needs goes on ctx as a plain attribute.
The engine (minidist/tensor.py) makes one per recorded call and releases it as soon as
that node's backward has run.

Those saved arrays are the "activations" of a training step, the memory that
activation checkpointing and several parallel strategies trade against compute and
communication. `MEMORY` counts their bytes while their node is alive: `live_bytes` now,
`peak_bytes` since the last `reset_peak()`. Parameters a node saves are not counted
(they are held anyway), and an array saved twice by one node counts once.

Parameters gathered on demand (ZeRO stage 3, FSDP: minidist/parallel/zero.py) are in
`ON_DEMAND`: a node that saves such a parameter's array keeps the parameter instead and
reads its `.data` when backward asks (`ctx.saved`), so freeing the gathered array after
forward really frees it, and the backward sees the array gathered again for it.
"""
import weakref

# Parameters whose .data is gathered before use and freed after (ZeRO-3, FSDP)
ON_DEMAND = weakref.WeakSet()


class _Later:
    """A saved parameter, read at backward time: `param.data` as it is then."""
    __slots__ = ("param",)

    def __init__(self, param):
        self.param = param

# ----------------------------------------------------------------------------- the meter


class _Memory:
    """Bytes of arrays saved for backward by nodes still alive in a graph."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, n):
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def reset_peak(self):
        self.peak_bytes = self.live_bytes


MEMORY = _Memory()

# ----------------------------------------------------------------------------- Context


class Context:
    """What a Function's forward leaves for its backward."""
    autocast = None           # mixed precision's rule, on the nodes it covers (minidist/precision.py)

    def __init__(self, needs_input_grad, param_ids, recording, params=()):
        self.needs_input_grad = needs_input_grad  # one bool per positional input
        self.saved = ()
        self._param_ids = param_ids               # ids of parameter arrays: not activations
        self._params = params                     # the parameter tensors themselves
        self._recording = recording
        self._bytes = 0

    @property
    def saved(self):
        s = self._saved
        if s is None or not self._lazy:
            return s
        return tuple(a.param.data if isinstance(a, _Later) else a for a in s)

    @saved.setter
    def saved(self, arrays):
        self._saved, self._lazy = arrays, False

    def save_for_backward(self, *arrays):
        if not self._recording:                   # under no_grad nothing is kept
            return
        self.saved = arrays
        if ON_DEMAND and self._params:            # keep gathered parameters by reference
            later = {id(t.data): t for t in self._params if t in ON_DEMAND}
            if later:
                self._saved = tuple(_Later(later[id(a)]) if id(a) in later else a for a in arrays)
                self._lazy = True
        seen = set(self._param_ids)               # count a shared buffer once per node
        n = 0
        for a in arrays:
            if a is not None and hasattr(a, "nbytes") and id(a) not in seen:
                seen.add(id(a))
                n += a.nbytes
        self._bytes = n
        MEMORY.add(n)

    def release(self):
        """Free the saved arrays (called once the node's backward has run)."""
        self.saved = None
        if self._bytes:
            MEMORY.add(-self._bytes)
            self._bytes = 0

    def __del__(self):                            # a graph dropped without backward
        if self._bytes:
            MEMORY.add(-self._bytes)
