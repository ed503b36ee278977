"""The autograd engine: Tensor, Function, backward(). Over 400 lines but one idea: the graph
and its walk (the Tensor, the node, the hooks and the deferred weight gradients the walk
fires) are read together; the ops themselves are in ops.py and fused.py.

A `Tensor` wraps an array (`.data`, NumPy or CuPy through `minidist.backend.xp`) and,
when it came out of a `Function`, the node that made it. Every op is a `Function` with
a `forward(ctx, *arrays)` and a `backward(ctx, grad)` that returns one gradient per
input (minidist/ops.py and minidist/fused.py hold them all). `loss.backward()` walks
the nodes in reverse topological order, hands each node the gradient of its outputs and
adds what it returns into the inputs: `.grad` of leaves (raw arrays, never Tensors), a
slot on the producing node for everything else.

Three things the parallel lessons need are built in here:
- `h = tensor.register_grad_ready_hook(fn)`: fn(tensor) runs as soon as a leaf's
  gradient for this backward pass is complete (bucketed data parallelism starts its
  all-reduce); `h.remove()` takes it off again (a model wrapped anew drops the old hooks);
- `backward_step_callback(fn)`: fn() runs after every node's backward, so posted MPI
  messages can make progress between ops (MPI only moves data inside MPI calls);
- `MEMORY`: bytes of arrays saved for backward by live nodes, the "activations" row
  (kept with `Context`, the ctx every forward saves into, in minidist/context.py).

And one that zero-bubble pipeline schedules need (Qi et al. 2024, arXiv 2401.10241):
- `with deferred_weight_grads() as later: out.backward(g)` splits the backward in two, as
  PyTorch's pipelining does with its input- and weight-gradient passes. An op that names
  `WEIGHT_INPUTS` (Linear: weight and bias; MatMul: either operand) computes the gradient
  of its input now, but for an operand that is a leaf (a Parameter) it computes nothing:
  the node keeps its saved input and gets to keep its output's gradient, and a
  `WeightGrad` goes on `later`. `run_weight_grads(later)` computes those gradients and adds
  them into .grad as the plain backward would. Everything else (layer norm, embeddings,
  attention, a head reached through a transpose: x @ wte.T) runs in full during B.

    python -c "from minidist.tensor import Tensor; x = Tensor([2.0], requires_grad=True); (x * x).sum().backward(); print(x.grad)"
"""
import contextlib

import numpy

from minidist.backend import to_device, to_numpy, xp
from minidist.context import MEMORY, Context  # noqa: F401  (MEMORY is re-exported)

# ----------------------------------------------------------------------------- switches

_GRAD_ENABLED = True
_STEP_CALLBACKS = []
_DEFERRED = None                # a list while deferred_weight_grads() is active


def is_grad_enabled():
    return _GRAD_ENABLED


@contextlib.contextmanager
def no_grad():
    """Run ops without recording a graph (evaluation, generation, optimizer steps)."""
    global _GRAD_ENABLED
    before, _GRAD_ENABLED = _GRAD_ENABLED, False
    try:
        yield
    finally:
        _GRAD_ENABLED = before


@contextlib.contextmanager
def backward_step_callback(fn):
    """While active, fn() is called after each node's backward in any backward()."""
    _STEP_CALLBACKS.append(fn)
    try:
        yield
    finally:
        _STEP_CALLBACKS.remove(fn)


@contextlib.contextmanager
def deferred_weight_grads():
    """While active, backward() leaves the weight gradients of splittable ops for later.

    Yields the list the WeightGrads go on, in the order the backward walk made them;
    `run_weight_grads(that list)` adds them into .grad. Nested, each backward appends to
    the innermost list (a checkpoint's inner backward included: its W runs later too).
    """
    global _DEFERRED
    before, _DEFERRED = _DEFERRED, []
    try:
        yield _DEFERRED
    finally:
        _DEFERRED = before


class WeightGrad:
    """One node's deferred weight gradients: the node's ctx (its saved input still held),
    the gradient of its output, and the (position, Parameter) pairs left to compute.

    fn None: a gradient B already computed (grad) for a Parameter that also has deferred
    ones (a tied weight used by an embedding and by a linear), held so that W adds all of
    its parts in the plain backward's order. While it waits, grad's bytes count in MEMORY
    beside the saved arrays: both are held until W runs, a split backward's price.
    """
    __slots__ = ("fn", "ctx", "grad", "params", "__weakref__")

    def __init__(self, fn, ctx, grad, params):
        self.fn, self.ctx, self.grad, self.params = fn, ctx, grad, params
        MEMORY.hold(self, grad.nbytes)            # settled by MEMORY if dropped without running

    def run(self, owned):
        """Compute, add into .grad (in input order, as the plain backward does), free."""
        for i, t in self.params:
            _accumulate_leaf(t, self.grad if self.fn is None else self.fn.backward_weight(self.ctx, self.grad, i),
                             owned)
        if self.ctx is not None:
            self.ctx.release()
        self.grad, self.params = None, ()
        MEMORY.free(self)


def run_weight_grads(later):
    """W: every WeightGrad of one B, in the order its walk made them; then the grad-ready
    hooks of the parameters they touched (their gradient of this pass is complete now)."""
    owned, touched = set(), {}
    callbacks = _STEP_CALLBACKS
    for wg in later:
        for _, t in wg.params:
            touched[id(t)] = t
        wg.run(owned)
        for fn in callbacks:
            fn()
    later.clear()
    for t in touched.values():
        _fire(t)

# ----------------------------------------------------------------------------- Function

# Mixed precision's autocast rule while `precision.autocast(...)` is on (None: off). The
# nodes of the ops it names run on 16-bit values; see minidist/precision.py.
_AUTOCAST = None


class Node:
    """One recorded call of a Function: its inputs and its outputs' gradient slots."""
    __slots__ = ("fn", "ctx", "inputs", "out_grads", "out_shapes")

    def __init__(self, fn, ctx, inputs, out_arrays):
        self.fn, self.ctx, self.inputs = fn, ctx, inputs
        self.out_grads = [None] * len(out_arrays)
        self.out_shapes = [(a.shape, a.dtype) for a in out_arrays]


class Function:
    """Subclass with staticmethods forward(ctx, *arrays, **kw) and backward(ctx, grad).

    forward gets the `.data` of Tensor inputs (other positional inputs as they are) and
    returns an array, or a tuple of arrays for several outputs; backward gets the
    gradient of each output (one array, or a tuple) and returns one gradient (or None)
    per positional input. Between the two, ctx (a Context) carries what forward saved.

    A Function whose backward can be split names the positions in WEIGHT_INPUTS and adds
    backward_weight(ctx, grad, i), the gradient of input i alone; its backward skips
    every input whose ctx.needs_input_grad is False (deferred_weight_grads sets them so).
    """
    WEIGHT_INPUTS = ()

    @staticmethod
    def forward(ctx, *arrays, **kw):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs, **kw):
        arrays = [t.data if isinstance(t, Tensor) else t for t in inputs]
        needs = tuple(isinstance(t, Tensor) and t.requires_grad for t in inputs)
        record = _GRAD_ENABLED and any(needs)
        params = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad
                  and t._node is None] if record else ()
        ctx = Context(needs, [id(t.data) for t in params], record, params)
        policy = _AUTOCAST if _AUTOCAST is not None and cls in _AUTOCAST.ops else None
        if policy is None:
            out = cls.forward(ctx, *arrays, **kw)
        else:                                     # mixed precision's rule (minidist/precision.py)
            ctx.autocast = policy
            out = policy.output(cls.forward(ctx, *policy.inputs(arrays), **kw))
        many = isinstance(out, tuple)
        outs = out if many else (out,)
        if not record:
            result = tuple(Tensor(o) for o in outs)
        else:
            node = Node(cls, ctx, tuple(inputs), outs)
            result = tuple(Tensor._from_node(o, node, i) for i, o in enumerate(outs))
        return result if many else result[0]

# ----------------------------------------------------------------------------- Tensor


class HookHandle:
    """What register_grad_ready_hook returns: `handle.remove()` unregisters the hook.

    Removing twice is harmless. (PyTorch's hooks return such a handle too.)
    """
    __slots__ = ("_tensor", "fn")

    def __init__(self, tensor, fn):
        self._tensor, self.fn = tensor, fn

    def remove(self):
        t, self._tensor = self._tensor, None
        if t is None or t._hooks is None:
            return
        for i, f in enumerate(t._hooks):
            if f is self.fn:                      # this registration only, by identity
                del t._hooks[i]
                break
        if not t._hooks:
            t._hooks = None                       # no hooks: backward skips the bookkeeping


def _can_have_grad(dtype):
    """Only floating (and complex) arrays have gradients: an integer has no small step."""
    return numpy.issubdtype(dtype, numpy.inexact)


class Tensor:
    __slots__ = ("data", "grad", "_requires_grad", "_node", "_slot", "_hooks", "__weakref__")

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        self.data = data if isinstance(data, xp.ndarray) else to_device(data)
        self.grad = None
        self._node = None
        self._slot = 0
        self._hooks = None
        self.requires_grad = requires_grad

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        value = bool(value)
        if value and not _can_have_grad(self.data.dtype):
            raise TypeError(f"requires_grad=True needs a floating-point tensor, not {self.data.dtype}: "
                            f"an integer tensor has no gradient (convert it first, e.g. "
                            f"Tensor(a.astype(numpy.float64), requires_grad=True))")
        self._requires_grad = value

    @classmethod
    def _from_node(cls, data, node, slot):
        t = cls(data, requires_grad=True)
        t._node, t._slot = node, slot
        return t

    # -- facts about the array
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._node is None)

    def item(self): return self.data.item()
    def numpy(self): return to_numpy(self.data)
    def detach(self): return Tensor(self.data)
    def __len__(self): return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad})"

    def register_grad_ready_hook(self, fn):
        """fn(self) runs during backward once this leaf's gradient is complete.

        Returns a HookHandle: `handle.remove()` unregisters fn again.
        """
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(fn)
        return HookHandle(self, fn)

    # -- backward
    def backward(self, grad=None):
        """Gradients of this tensor with respect to every leaf that requires grad.

        grad defaults to 1 for a one-element tensor; any other tensor needs an explicit
        grad of its shape (pipeline stages receive it from the next stage).
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward() without grad needs a one-element tensor, not shape {self.shape}")
            grad = xp.ones_like(self.data)
        else:
            # a private copy: the caller's array must never become some leaf's .grad
            # (an in-place change to one would change the other)
            grad = xp.array(grad.data if isinstance(grad, Tensor) else grad, dtype=self.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"grad has shape {grad.shape}, the tensor has shape {self.shape}")
        if self._node is None:                    # a leaf: its gradient is grad itself
            _accumulate_leaf(self, grad, set())
            _fire(self)
            return
        order = _topological_order(self._node)
        _check_not_freed(order)                   # before any .grad is touched
        pending = _pending_consumers(order)
        self._node.out_grads[self._slot] = grad
        owned = set()                             # ids of arrays already given to a leaf
        callbacks = _STEP_CALLBACKS
        split = _deferred_leaves(order) if _DEFERRED is not None else None
        for node in reversed(order):
            ctx = node.ctx
            grads = [g if g is not None else xp.zeros(s, d)
                     for g, (s, d) in zip(node.out_grads, node.out_shapes)]
            node.out_grads = None
            later = _defer(node) if _DEFERRED is not None and node.fn.WEIGHT_INPUTS else None
            policy = ctx.autocast
            if policy is not None:                # a 16-bit node: 16-bit gradients in
                grads = [policy.round(g) for g in grads]
            in_grads = node.fn.backward(ctx, tuple(grads) if len(grads) > 1 else grads[0])
            if later:                             # W computes these; the ctx stays alive for it
                _DEFERRED.append(WeightGrad(node.fn, ctx, grads[0], later))
            else:
                ctx.release()
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if policy is not None:                # ... and 16-bit activation gradients out
                in_grads = policy.grads_out(in_grads, node.inputs)
            for t, g in zip(node.inputs, in_grads):
                if not isinstance(t, Tensor) or not t.requires_grad:
                    continue
                if t._node is None:
                    if split is not None and id(t) in split:   # W adds it, in this order
                        if g is not None:
                            _DEFERRED.append(WeightGrad(None, None, _own(g, t, owned), [(None, t)]))
                        continue                  # incomplete until W: no hook fires now
                    if g is not None:
                        _accumulate_leaf(t, g, owned)
                    if t._hooks is not None:          # complete once every consumer added
                        pending[id(t)] -= 1
                        if pending[id(t)] == 0:
                            _fire(t)
                elif g is not None:
                    slots = t._node.out_grads
                    old = slots[t._slot]
                    slots[t._slot] = g if old is None else old + g
            node.inputs = ()                      # let the graph go as we walk it
            for fn in callbacks:
                fn()

    # -- operators (the Functions live in minidist/ops.py)
    def _lift(self, other):
        if isinstance(other, Tensor):
            return other
        if isinstance(other, float) and not _can_have_grad(self.dtype):
            return Tensor(xp.full((), other, dtype=xp.float64))   # int tensor * 0.5 is 0.5 x, not 0 x
        if isinstance(other, (int, float, numpy.generic)):    # a scalar: filled in on the device
            return Tensor(xp.full((), other, dtype=self.dtype))   # python scalars keep our dtype
        return Tensor(to_device(other, dtype=self.dtype))

    def __add__(self, o): return _ops().add(self, self._lift(o))
    def __radd__(self, o): return _ops().add(self._lift(o), self)
    def __sub__(self, o): return _ops().sub(self, self._lift(o))
    def __rsub__(self, o): return _ops().sub(self._lift(o), self)
    def __mul__(self, o): return _ops().mul(self, self._lift(o))
    def __rmul__(self, o): return _ops().mul(self._lift(o), self)
    def __truediv__(self, o): return _ops().div(self, self._lift(o))
    def __rtruediv__(self, o): return _ops().div(self._lift(o), self)
    def __matmul__(self, o): return _ops().matmul(self, self._lift(o))
    def __neg__(self): return _ops().neg(self)
    def __getitem__(self, index): return _ops().getitem(self, index)

    def transpose(self, a, b): return _ops().transpose(self, a, b)
    def sum(self, axis=None, keepdims=False): return _ops().sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _ops().mean(self, axis, keepdims)
    T = property(lambda self: _ops().transpose(self, -1, -2))

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _ops().reshape(self, shape)

    view = reshape


def _ops():
    from minidist import ops   # ops imports this module; import late to avoid a cycle
    return ops


def _accumulate_leaf(t, g, owned):
    """Add g into t.grad. Never write into an array someone else may hold."""
    if g.dtype != t.data.dtype:
        g = g.astype(t.data.dtype)
    if t.grad is None:
        if id(g) in owned or g.base is not None or g.shape != t.shape:
            g = xp.array(xp.broadcast_to(g, t.shape))   # a private copy
        owned.add(id(g))
        t.grad = g
    else:
        t.grad = t.grad + g        # a new array: the old one may be shared with a caller


def _deferred_leaves(order):
    """ids of the leaves some node of this graph will defer (see _defer): all their
    gradients of this backward wait for W, so W adds them in the walk's order."""
    out = set()
    for node in order:
        ins = node.inputs
        for i in node.fn.WEIGHT_INPUTS:
            if i < len(ins) and isinstance(ins[i], Tensor) and ins[i].requires_grad and ins[i]._node is None:
                out.add(id(ins[i]))
    return out or None


def _own(g, t, owned):
    """g as a private array for t's .grad later (as _accumulate_leaf would make it now)."""
    if id(g) in owned or g.base is not None or g.shape != t.shape:
        g = xp.array(xp.broadcast_to(g, t.shape))
    owned.add(id(g))
    return g


def _defer(node):
    """The (position, leaf) pairs of a splittable node whose gradients W will compute;
    marks them not needed now, so the node's backward computes only the rest."""
    ins = node.inputs
    later = [(i, ins[i]) for i in node.fn.WEIGHT_INPUTS if i < len(ins) and isinstance(ins[i], Tensor)
             and ins[i].requires_grad and ins[i]._node is None]
    if later:
        skip = {i for i, _ in later}
        node.ctx.needs_input_grad = tuple(n and i not in skip for i, n in enumerate(node.ctx.needs_input_grad))
    return later


def _fire(t):
    if t._hooks is not None:
        for fn in t._hooks:
            fn(t)


def _check_not_freed(order):
    """Refuse, before anything is written, a graph that an earlier backward already ran.

    Each node frees its saved arrays once its backward has run. A second backward()
    through any of them (the same loss twice, or a second loss sharing part of the
    graph) cannot work; finding that halfway would leave some leaves' .grad written.
    """
    for node in order:
        if node.out_grads is None or node.ctx.saved is None:
            raise RuntimeError(
                f"backward() through a graph that an earlier backward() already ran: the saved arrays "
                f"of its {node.fn.__name__} node are freed. Run the forward again to build a new graph "
                f"(no .grad was changed by this call)")


def _topological_order(root):
    """Nodes reachable from root, every node after all the nodes it consumes."""
    order, seen = [], {id(root)}
    stack = [(root, iter(root.inputs))]
    while stack:
        node, it = stack[-1]
        for t in it:
            child = t._node if isinstance(t, Tensor) else None
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append((child, iter(child.inputs)))
                break
        else:
            stack.pop()
            order.append(node)
    return order


def _pending_consumers(order):
    """For leaves with grad-ready hooks: how many nodes of this graph will add to .grad."""
    pending = {}
    for node in order:
        for t in node.inputs:
            if isinstance(t, Tensor) and t._hooks is not None and t._node is None and t.requires_grad:
                pending[id(t)] = pending.get(id(t), 0) + 1
    return pending
