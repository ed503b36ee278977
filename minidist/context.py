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
"""

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

    def __init__(self, needs_input_grad, param_ids, recording):
        self.needs_input_grad = needs_input_grad  # one bool per positional input
        self.saved = ()
        self._param_ids = param_ids               # ids of parameter arrays: not activations
        self._recording = recording
        self._bytes = 0

    def save_for_backward(self, *arrays):
        if not self._recording:                   # under no_grad nothing is kept
            return
        self.saved = arrays
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
