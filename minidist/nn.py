"""Modules: Parameter, Module, and the layers a GPT is made of.

A Module keeps its parameters and sub-modules as attributes; named_parameters() walks
them in the order they were assigned, with dotted names ("transformer.h.0.ln_1.weight"),
exactly the names nanoGPT (and so a PyTorch state_dict) uses.

    python -c "from minidist.nn import Linear; print(Linear(4, 3).named_parameters())"
"""
import numpy

from minidist import ops
from minidist.backend import dtype_of, to_device, xp
from minidist.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that requires grad: what the optimizer updates."""
    __slots__ = ()

    def __init__(self, data):
        super().__init__(data, requires_grad=True)


class Module:
    training = True

    def forward(self, *args, **kw):
        raise NotImplementedError

    def __call__(self, *args, **kw):
        hooks = self.__dict__.get("_forward_hooks")
        if not hooks:
            return self.forward(*args, **kw)
        for pre, _ in hooks:                      # e.g. ZeRO-3 / FSDP gather the parameters
            if pre is not None:
                pre(self, args)
        out = self.forward(*args, **kw)
        for _, post in hooks:                     # ... and free them, or mark the output
            if post is not None:
                res = post(self, args, out)
                out = out if res is None else res
        return out

    def register_forward_hooks(self, pre=None, post=None):
        """pre(module, args) runs before forward, post(module, args, output) after it
        (what post returns, unless None, replaces the output), as PyTorch's forward
        pre-hooks and hooks. Returns a handle whose remove() takes them off."""
        hooks = self.__dict__.setdefault("_forward_hooks", [])
        entry = (pre, post)
        hooks.append(entry)
        return _ForwardHookHandle(hooks, entry)

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield from value.named_modules(f"{prefix}{name}.")

    def modules(self):
        return [m for _, m in self.named_modules()]

    def named_parameters(self):
        """[(dotted name, Parameter)] in registration order, each parameter once (ties)."""
        out, seen = [], set()
        for prefix, module in self.named_modules():
            for name, value in vars(module).items():
                if isinstance(value, Parameter) and id(value) not in seen:
                    seen.add(id(value))
                    out.append((prefix + name, value))
        return out

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train(self, mode=True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state):
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in state]
        extra = [n for n in state if n not in params]
        if missing or extra:
            raise KeyError(f"load_state_dict: missing {missing}, unexpected {extra}")
        for name, p in params.items():
            a = state[name]
            if tuple(a.shape) != p.shape:
                raise ValueError(f"load_state_dict: {name} has shape {tuple(a.shape)}, the model expects {p.shape}")
            p.data = to_device(a, dtype=p.dtype).copy()     # a host array crosses (counted)


class _ForwardHookHandle:
    def __init__(self, hooks, entry):
        self.hooks, self.entry = hooks, entry

    def remove(self):
        if self.entry in self.hooks:
            self.hooks.remove(self.entry)


class ModuleList(Module):
    """Sub-modules named 0, 1, 2, ... (nanoGPT's transformer.h)."""

    def __init__(self, modules=()):
        for i, m in enumerate(modules):
            setattr(self, str(i), m)
        self._n = len(modules)

    def __iter__(self):
        return (getattr(self, str(i)) for i in range(self._n))

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        return getattr(self, str(range(self._n)[i]))


class ModuleDict(Module):
    """Sub-modules under names (nanoGPT's transformer.wte, .wpe, .h, .ln_f)."""

    def __init__(self, **modules):
        for name, m in modules.items():
            setattr(self, name, m)

    def __getitem__(self, name):
        return getattr(self, name)


def _default_rng(rng):
    return rng if rng is not None else numpy.random.default_rng(0)


class Linear(Module):
    """y = x @ W + b with W of shape (in_features, out_features): column splits are splits
    of W's last axis (the transpose of PyTorch's nn.Linear.weight)."""

    def __init__(self, in_features, out_features, bias=True, dtype="float32", rng=None):
        dt = dtype_of(dtype)
        w = _default_rng(rng).normal(0.0, 0.02, size=(in_features, out_features))   # on the host
        self.weight = Parameter(to_device(w.astype(dt)))
        self.bias = Parameter(xp.zeros(out_features, dt)) if bias else None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    def __init__(self, n, bias=True, dtype="float32"):
        dt = dtype_of(dtype)
        self.weight = Parameter(xp.ones(n, dt))
        self.bias = Parameter(xp.zeros(n, dt)) if bias else None

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, eps=1e-5)


class Embedding(Module):
    def __init__(self, num_embeddings, embedding_dim, dtype="float32", rng=None):
        w = _default_rng(rng).normal(0.0, 0.02, size=(num_embeddings, embedding_dim))   # on the host
        self.weight = Parameter(to_device(w.astype(dtype_of(dtype))))

    def forward(self, idx):
        return ops.embedding(idx, self.weight)


class Dropout(Module):
    """Dropout with probability p while training; the DropoutRNG comes at call time."""

    def __init__(self, p=0.0):
        self.p = p

    def forward(self, x, rng=None):
        if not self.training or self.p == 0.0:
            return x
        if rng is None:
            raise ValueError("Dropout with p > 0 needs a DropoutRNG while training")
        return ops.dropout(x, self.p, rng)
