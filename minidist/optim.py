"""Optimizers: SGD, AdamW (as torch.optim.AdamW), clip_grad_norm.

Each parameter's `.grad` is a raw array; updates happen in place on `.data`, so the
arrays other parts hold (a ZeRO shard, a bucket view) stay the same objects.
AdamW keeps two arrays per parameter (exp_avg, exp_avg_sq): `state_bytes()` is the
"optimizer" row of a memory table (8 bytes per float32 parameter).

    opt = model.configure_optimizers(weight_decay=0.1, lr=1e-3)
    loss.backward(); clip_grad_norm(model.parameters(), 1.0); opt.step(); opt.zero_grad()
"""
import math

from minidist.backend import to_numpy, xp


class Optimizer:
    def __init__(self, params_or_groups, defaults):
        items = list(params_or_groups)
        if items and isinstance(items[0], dict):
            groups = items
        else:
            groups = [{"params": items}]
        self.param_groups = []
        for g in groups:
            group = dict(defaults)
            group.update(g)
            group["params"] = list(group["params"])
            self.param_groups.append(group)
        self.state = {}                   # id(param) -> {name: array}

    def parameters(self):
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def store_grads(self):
        """train_step calls this after the gradients are synchronised: a plain optimizer
        keeps them where they are (precision.MixedPrecision stores them in its dtype)."""

    def set_lr(self, lr):
        """Set the learning rate of every group (a schedule calls this once per step)."""
        for g in self.param_groups:
            g["lr"] = lr

    @property
    def lr(self):
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        self.set_lr(value)

    def state_bytes(self):
        return sum(a.nbytes for s in self.state.values() for a in s.values() if hasattr(a, "nbytes"))

    # -- what a checkpoint reads of an optimizer (minidist/parallel/pieces.py, checkpoint/layouts.py)
    def adamw(self):
        """The AdamW whose m, v and step a checkpoint holds (None: an optimizer without them)."""
        return None

    def checkpoint_params(self, params):
        """The tensors this optimizer keeps state for, one per parameter in `params`: the
        parameters themselves (precision.MixedPrecision: their fp32 masters)."""
        return list(params)

    def checkpoint_loaded(self):
        """After a load has filled the tensors of checkpoint_params (MixedPrecision: round
        the masters into the model's 16-bit weights, as after a step)."""


class SGD(Optimizer):
    """p -= lr * (g + wd p), with momentum buf = momentum * buf + g when momentum > 0."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def step(self):
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + wd * p.data if wd else p.grad
                if mom:
                    s = self.state.setdefault(id(p), {})
                    if "momentum_buffer" not in s:
                        s["momentum_buffer"] = xp.array(g, dtype=p.dtype)
                    else:
                        s["momentum_buffer"] *= mom
                        s["momentum_buffer"] += g
                    g = s["momentum_buffer"]
                p.data -= lr * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2017), as torch.optim.AdamW:

        p  -= lr * wd * p
        m   = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
        p  -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    def __init__(self, params_or_groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01):
        super().__init__(params_or_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.variance_frozen = False

    def adamw(self):
        return self

    def freeze_variance(self):
        """From now on keep v (and its bias correction) as it is: 1-bit Adam's preconditioner
        after its warm-up (Tang et al. 2021). Gradients compressed to signs with one scale
        per chunk would otherwise make v the same for every element of a chunk, and Adam's
        per-element step sizes would be lost (lesson 10)."""
        self.variance_frozen = True

    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                s = self.state.get(id(p))
                if s is None:
                    s = self.state[id(p)] = {"step": 0, "exp_avg": xp.zeros_like(p.data),
                                             "exp_avg_sq": xp.zeros_like(p.data)}
                s["step"] += 1
                t, m, v = s["step"], s["exp_avg"], s["exp_avg_sq"]
                if wd:
                    p.data *= 1.0 - lr * wd
                m *= b1
                m += (1.0 - b1) * g
                if self.variance_frozen:                  # 1-bit Adam: v as it was at the freeze
                    tmp = xp.sqrt(v)
                else:
                    v *= b2
                    tmp = g * g
                    tmp *= 1.0 - b2
                    v += tmp
                    s["v_step"] = t
                    xp.sqrt(v, out=tmp)                   # denominator, in the same buffer
                tmp *= 1.0 / math.sqrt(1.0 - b2 ** s["v_step"])
                tmp += eps
                xp.divide(m, tmp, out=tmp)
                tmp *= lr / (1.0 - b1 ** t)
                p.data -= tmp


def grad_norm_sq(params):
    """The squared L2 norm of the gradients these parameters hold, all of them together.

    Each tensor's square sum is taken where the gradient lives and they are added there in
    float64, one after the other in parameter order (the last of their running sums: NumPy's
    cumsum adds in order, so the CPU's figures are those of a Python sum); one number comes
    home. (A GPU's cumsum is a parallel scan: its last bits may differ.)"""
    parts = [xp.vdot(p.grad.ravel(), p.grad.ravel()) for p in params if p.grad is not None]
    if not parts:
        return 0
    return float(to_numpy(xp.cumsum(xp.stack(parts).astype(xp.float64))[-1]))   # one float home


def clip_grad_norm(params, max_norm, norm_sq=None):
    """Scale all gradients in place so their global L2 norm is at most max_norm.
    Returns the norm before clipping (a float).

    norm_sq: the squared norm of the whole model's gradient when these parameters are
    only part of it (a tensor-parallel shard: tp_model.TensorParallelSync.grad_norm_sq);
    by default the norm of these gradients."""
    total = math.sqrt(grad_norm_sq(params) if norm_sq is None else norm_sq)
    if total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad = p.grad * scale               # a new array: never write into a shared one
    return total
