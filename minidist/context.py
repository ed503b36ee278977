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
    """Bytes of arrays saved for backward by nodes still alive in a graph.

    An owner (a node's Context, a deferred weight gradient) holds its bytes until it frees
    them. One dropped without freeing (a graph that never ran backward) is settled through a
    weak reference whose callback is a list's append: C code, where a Python `__del__` would
    run Python code. Python swallows any exception raised inside a finaliser, so a Ctrl-C
    that landed in a `__del__` (about 1 in 150 during training, measured) was lost.
    """

    def __init__(self):
        self._live = 0
        self.peak_bytes = 0
        self._held = {}                           # weak reference to an owner -> its bytes
        self._dropped = []                        # references whose owners died holding bytes

    def _settle(self):
        while self._dropped:
            self._live -= self._held.pop(self._dropped.pop(), 0)

    @property
    def live_bytes(self):
        self._settle()
        return self._live

    def hold(self, owner, n):
        """`owner` keeps n more bytes alive until free(owner), or until it is dropped."""
        self._settle()
        key = weakref.ref(owner, self._dropped.append)
        self._held[key] = self._held.pop(key, 0) + n
        self._live += n
        if self._live > self.peak_bytes:
            self.peak_bytes = self._live

    def free(self, owner):
        """Everything `owner` holds is released now."""
        self._live -= self._held.pop(weakref.ref(owner), 0)

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
        if n:
            MEMORY.hold(self, n)

    def release(self):
        """Free the saved arrays (called once the node's backward has run)."""
        self.saved = None
        if self._bytes:
            MEMORY.free(self)
            self._bytes = 0
