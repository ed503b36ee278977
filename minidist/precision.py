"""Mixed precision: 16-bit matmuls, fp32 master weights and optimizer state, loss scaling.

    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --precision bf16

Every large run trains this way (Micikevicius et al. 2018, "Mixed Precision Training").
Three pieces, each in one place here:

1. THE AUTOCAST RULE (`SIXTEEN_BIT`, applied by the engine in Function.apply and in the
   backward walk, minidist/tensor.py, nowhere else):
   - 16-bit: every matrix product: Linear, MatMul (the head x @ wte.T) and the attention
     node's two products. Its inputs are rounded to 16 bits, the products are summed in
     fp32 and the result is rounded to 16 bits: what a GPU's tensor cores do (the product
     of two 16-bit numbers is exact in fp32; the accumulator is fp32). In backward the
     same: the incoming gradient is rounded to 16 bits, the activation gradients leaving
     the node are rounded; the weight gradients leave the GEMM in fp32 (fp32
     accumulation) and the optimizer side decides how they are stored.
   - fp32: everything else: softmax (inside attention too), layer norm and its
     statistics, GELU, dropout, the residual additions, the cross-entropy loss.
   Where this rule is this project's choice: PyTorch's autocast runs GELU in its input's
   dtype and Megatron's bf16 keeps the residual stream in bf16 (unless
   --fp32-residual-connection); inside the attention node the probabilities stay fp32
   into P V, where FlashAttention rounds P to 16 bits first. Weight gradients in fp32
   from the GEMM are Megatron's (gradient accumulation fusion into main_grad); under
   torch.autocast they leave the GEMM in 16 bits.
   NumPy has no 16-bit matrix multiply (and no bfloat16 at all: the small `ml_dtypes`
   package, which JAX uses, supplies it), so the engine multiplies float32 arrays that
   hold 16-bit values: the matmuls' inputs and outputs are the values a GPU's would be;
   the float32 containers are this project's emulation, and why time is not saved here.

2. MASTER WEIGHTS (`MixedPrecision`): the model's weights hold 16-bit values; the
   optimizer keeps an fp32 copy (the master) and fp32 AdamW state, applies the update to
   the master, and rounds it into the model's weights. Without the master, an update
   smaller than half a 16-bit step (bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1)
   would vanish. Bytes per parameter, two accountings (the lesson measures the first two
   rows from its arrays and prints the distributed optimizer's as a formula):
   - the ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020, section 3.1): fp16
     weights 2 + fp16 gradients 2 + fp32 master, m, v 4 + 4 + 4 = 16 bytes (K = 12);
   - Megatron-LM with bf16 (its default keeps fp32 gradients, "main_grad"): 2 + 4 + 12
     = 18 bytes; with its distributed optimizer the 12 are sharded over d data-parallel
     ranks: 6 + 12/d (Megatron-LM's docs, distributed optimizer; plan.memory.bytes_per_param).

3. LOSS SCALING (`GradScaler`, fp16 only): fp16 keeps 5 exponent bits: below 2^-14 it
   loses precision (subnormals) and at or below 2^-25 a gradient becomes zero. Multiply the loss by S before backward (every gradient is
   multiplied by S), divide the gradients by S before the step, and pick S dynamically as
   PyTorch's GradScaler does by default: start at 2^16; an inf or nan in any gradient
   halves S and SKIPS the step; 2000 good steps in a row double S. S is a power of two,
   so scaling and unscaling are exact: the unscaled gradients equal the unscaled run's
   as long as nothing overflows. bf16 has fp32's exponent range and needs no scaling.
   HYSTERESIS (GradScaler(hysteresis=h)): every overflowed step is still skipped, but S
   is halved only at the h-th overflow since S last grew (or since the start); one
   stray overflow does not cost a halving. The constants in use (defaults):
   - PyTorch torch.amp.GradScaler: init_scale 2^16, growth_interval 2000, backoff 0.5,
     no hysteresis (h = 1);
   - Megatron-LM (megatron/core/optimizer/grad_scaler.py, DynamicGradScaler; flags
     --initial-loss-scale 2^32, --loss-scale-window 1000, --hysteresis 2,
     --min-loss-scale 1): a hysteresis counter that each overflow decrements, S halved
     (never below min_scale) once it reaches 0, and reset to h only when S grows;
   - DeepSpeed (fp16 config: initial_scale_power 16, i.e. 2^16, loss_scale_window 1000,
     hysteresis 2, min_loss_scale 1; deepspeed/runtime/fp16/loss_scaler.py,
     DynamicLossScaler, whose counter is reset when S grows, or after every good step
     with consecutive_hysteresis).
   This GradScaler counts as Megatron's does; the lesson's --hysteresis sets h.

ON A DEVICE (MINIDIST_DEVICE=cuda, or the strict double): CuPy has no bfloat16 dtype, so
there bf16 is rounded in float32 arithmetic on the float32 bits (round to nearest, ties to
even: add 0x7FFF plus the lowest kept bit, clear the low 16 bits; a float64 value first
reaches float32 rounded to odd, so it is rounded once; `round_bf16`) and a
16-bit bf16 array is stored as its uint16 bit patterns (`store16` / `load16`): the same
values and the same bytes as ml_dtypes' bfloat16 on the host, which the CPU keeps. fp16
is CuPy's float16. unscale_grads reads one flag home per step (any inf or nan), not one per
gradient. These are this project's choices for its emulation.
"""
import contextlib
import math

import numpy as np

from minidist import tensor as _tensor
from minidist.backend import on_device, to_numpy, xp

PRECISIONS = ("fp32", "bf16", "fp16")


def dtype16(precision):
    """The NumPy dtype of a 16-bit format: ml_dtypes.bfloat16 or numpy.float16 (None for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp32":
        return None
    if precision == "fp16":
        return np.dtype(np.float16)
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def is_bf16(dt):
    return dt is not None and np.dtype(dt).name == "bfloat16"


def _float32_round_to_odd(a, m):
    """float64 a as float32 bits rounded to odd (truncate, then set the lowest bit if
    anything was cut): rounding those to bf16 is then a's correct rounding, with no double
    rounding (24 bits hold bf16's 8 and 2 more; Boldo and Melquiond 2008)."""
    f = a.astype(np.float32)
    back = f.astype(a.dtype)
    u = f.view(np.uint32)
    cut = back != a
    u = m.where(cut & (m.abs(back) > m.abs(a)), u - 1, u)     # one step toward zero
    return m.where(cut, u | 1, u).view(np.float32)


def round_bf16(a):
    """a rounded to bf16 in float32 arithmetic (a device has no bfloat16 dtype), in a's own
    dtype: the float32 bits plus 0x7FFF plus the lowest kept bit, the low 16 bits cleared
    (round to nearest, ties to even; a float64 a reaches float32 rounded to odd, so it is
    rounded once, as ml_dtypes does). inf stays inf; a nan stays a nan."""
    m = xp if on_device(a) else np
    with np.errstate(over="ignore", invalid="ignore"):    # beyond float32: inf, as bf16's
        f = _float32_round_to_odd(a, m) if a.dtype.itemsize > 4 else a.astype(np.float32)
    u = f.view(np.uint32)
    r = ((u + ((u >> 16) & 1) + 0x7FFF) & 0xFFFF0000).view(np.float32)
    return m.where(m.isnan(f), f, r).astype(a.dtype)


def store16(a, dt):
    """a (a float array) in dt's storage: a.astype(dt), but on a device bf16 as its uint16
    bit patterns (2 bytes each, as bfloat16's)."""
    if is_bf16(dt) and on_device(a):
        return (round_bf16(a).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return a.astype(dt)


def load16(s, dt, dtype=np.float32):
    """The values of a store16(_, dt) array, as dtype."""
    if is_bf16(dt) and on_device(s):
        return (s.astype(np.uint32) << 16).view(np.float32).astype(dtype)
    return s.astype(dtype)


def round_to(a, dt):
    """a's values rounded to the 16-bit dtype dt (nearest, ties to even), in a's own dtype.

    fp16 overflows to inf above 65504 (that is what loss scaling watches for). bf16 on a
    device: round_bf16 (CuPy has no bfloat16)."""
    if is_bf16(dt) and on_device(a):
        return round_bf16(a)
    with np.errstate(over="ignore"):
        return a.astype(dt).astype(a.dtype)


# ----------------------------------------------------------------------------- 1. autocast

def _sixteen_bit_ops():
    from minidist import fused, ops
    return (ops.Linear, ops.MatMul, fused.CausalAttention)


class Autocast:
    """The rule, as the engine applies it (minidist/tensor.py calls these four methods)."""

    def __init__(self, precision):
        self.precision, self.dt = precision, dtype16(precision)
        self.ops = _sixteen_bit_ops()

    def round(self, a):
        return round_to(a, self.dt) if hasattr(a, "dtype") and a.dtype.kind == "f" else a

    def inputs(self, arrays):
        """Forward: every float input of a 16-bit op rounded to 16 bits."""
        return [self.round(a) for a in arrays]

    def output(self, out):
        """Forward: the fp32-accumulated result stored in 16 bits."""
        return tuple(self.round(o) for o in out) if isinstance(out, tuple) else self.round(out)

    def grads_out(self, grads, inputs):
        """Backward: activation gradients rounded to 16 bits; a weight's stays fp32, as the
        GEMM's fp32 accumulator left it (Megatron accumulates it so, into main_grad)."""
        return tuple(g if g is None or _is_weight(t) else self.round(g) for g, t in zip(grads, inputs))


_VIEWS = ("Transpose", "Reshape", "SwapAxes")


def _is_weight(t):
    """A leaf (a Parameter), or a view of one taken on the way to the matmul: the tied
    head multiplies by wte.weight.T, a Transpose node over the leaf."""
    node = getattr(t, "_node", 0)
    if node is None:
        return True
    if node == 0 or node.fn.__name__ not in _VIEWS:
        return False
    return all(_is_weight(x) for x in node.inputs if hasattr(x, "_node"))


@contextlib.contextmanager
def autocast(precision):
    """Run the block's forward (and, through the nodes it records, their backward) under
    the rule above. autocast("fp32") changes nothing."""
    old = _tensor._AUTOCAST
    _tensor._AUTOCAST = Autocast(precision) if precision != "fp32" else None
    try:
        yield
    finally:
        _tensor._AUTOCAST = old


# ----------------------------------------------------------------------------- 2. master weights

class MixedPrecision:
    """An optimizer whose model computes in 16 bits: fp32 master weights beside it.

        opt = MixedPrecision(model.configure_optimizers(...), model, "bf16")

    `inner` (an optim.AdamW over the model's parameters) is re-pointed at fp32 masters,
    group for group, so weight decay stays where it was. After every step the model's
    weights are the masters rounded to 16 bits. `grad_dtype`: how the gradients are
    stored before the step: "16" (the ZeRO paper's 2 bytes) or "fp32" (Megatron's
    main_grad, 4 bytes); the default is fp32 for bf16 and 16 bits for fp16.
    """

    def __init__(self, inner, model, precision, grad_dtype=None):
        self.inner, self.model, self.precision = inner, model, precision
        self.dt = dtype16(precision)
        if self.dt is None:
            raise ValueError("MixedPrecision needs bf16 or fp16; fp32 trains with the optimizer alone")
        grad_dtype = grad_dtype or ("fp32" if precision == "bf16" else "16")
        if grad_dtype not in ("16", "fp32"):
            raise ValueError(f"grad_dtype must be '16' or 'fp32', not {grad_dtype!r}")
        self.grad_dt = self.dt if grad_dtype == "16" else np.dtype(np.float32)
        from minidist.nn import Parameter
        self.params = list(model.parameters())
        self.master = {id(p): Parameter(xp.array(p.data, dtype=np.float32)) for p in self.params}
        for g in inner.param_groups:
            g["params"] = [self.master[id(p)] for p in g["params"]]
        self.param_groups = inner.param_groups
        self.weights16 = [store16(p.data, self.dt) for p in self.params]  # the 16-bit model weights
        self.grads = [None] * len(self.params)                           # as stored, grad_dt
        self._round_weights()

    def _round_weights(self):
        for p, w16 in zip(self.params, self.weights16):
            p.data[...] = load16(w16, self.dt, p.data.dtype)   # float32 holding 16-bit values

    # -- the optimizer's face
    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def set_lr(self, lr):
        self.inner.set_lr(lr)

    def store_grads(self):
        """Keep each gradient in the storage dtype (rounding it when that is 16 bits)."""
        for i, p in enumerate(self.params):
            self.grads[i] = None if p.grad is None else store16(xp.asarray(p.grad), self.grad_dt)
            if p.grad is not None:
                p.grad = load16(self.grads[i], self.grad_dt)

    def step(self):
        """fp32 update of the masters from the model's (unscaled) gradients; round into the model."""
        for i, p in enumerate(self.params):
            m = self.master[id(p)]
            m.grad = None if p.grad is None else xp.asarray(p.grad, dtype=np.float32)
        self.inner.step()
        for i, p in enumerate(self.params):
            self.weights16[i][...] = store16(self.master[id(p)].data, self.dt)
        self._round_weights()

    def memory(self):
        """Bytes this rank holds per category, read from the arrays (the float32 containers
        the engine multiplies are the emulation's, not counted: a GPU multiplies the 16-bit
        weights themselves)."""
        return {"weights": sum(w.nbytes for w in self.weights16),
                "grads": sum(g.nbytes for g in self.grads if g is not None),
                "master": sum(self.master[id(p)].data.nbytes for p in self.params),
                "optimizer": self.inner.state_bytes()}

    def state_bytes(self):
        return self.inner.state_bytes()

    # -- what a checkpoint reads (optim.Optimizer's hooks): the fp32 masters are the record
    def adamw(self):
        return self.inner.adamw()

    def checkpoint_params(self, params):
        return [self.master[id(p)] for p in params]

    def checkpoint_loaded(self):
        for i, p in enumerate(self.params):
            self.weights16[i][...] = store16(self.master[id(p)].data, self.dt)
        self._round_weights()


# ----------------------------------------------------------------------------- 3. loss scaling

def unscale_grads(grads, scale):
    """(the gradients divided by scale, in fp32, as new arrays; found_inf): found_inf is
    True when any gradient holds an inf or a nan. None stays None. (Exercise 10.1.)

    fp32 whatever the gradients' dtype: they are about to update the fp32 masters. Device
    gradients stay on the device; found_inf comes home once, for all of them."""
    inv = 1.0 / scale
    out, finite = [], []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        m = xp if on_device(g) else np
        u = m.asarray(g, dtype=np.float32) * np.float32(inv)
        finite.append(m.all(m.isfinite(u)))
        out.append(u)
    if not finite:
        return out, False
    m = xp if on_device(finite[0]) else np
    return out, not bool(to_numpy(m.all(m.stack(finite))))       # one flag home


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    """The next (scale, good_steps): an inf halves the scale and restarts the count; the
    growth_interval-th good step in a row doubles it and restarts. (Exercise 10.2.)"""
    if found_inf:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps


class GradScaler:
    """Dynamic loss scaling, PyTorch's GradScaler defaults. train_step uses it so:

        loss * scaler.scale -> backward -> (sync) -> scaler.unscale_(params)
        -> clip -> step unless scaler.found_inf -> scaler.update()

    comm: under ZeRO each rank sees only its partition of the gradients, so the ranks
    agree on found_inf (one small message); data parallelism's replicas agree anyway.
    Under tensor or pipeline parallelism comm must hold every rank that holds gradients
    (the model-parallel group too, as Megatron all-reduces found_inf over it).
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, comm=None, hysteresis=1, min_scale=0.0):
        for name, v in (("init_scale", init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number, not {v}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be at least 1, not {growth_interval}")
        if hysteresis < 1 or not min_scale >= 0:
            raise ValueError(f"hysteresis must be at least 1 and min_scale 0 or more, not {hysteresis} "
                             f"and {min_scale}")
        self.hysteresis, self.hysteresis_left, self.min_scale = int(hysteresis), int(hysteresis), min_scale
        self.scale, self.good_steps = float(init_scale), 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.comm = growth_interval, comm
        self.found_inf, self.skipped, self.history = False, 0, []

    def unscale_(self, params):
        grads, found = unscale_grads([p.grad for p in params], self.scale)
        if self.comm is not None and self.comm.Get_size() > 1:
            from minidist.comm import agree
            found = not agree(self.comm, not found)
        for p, g in zip(params, grads):
            p.grad = g
        self.found_inf = found
        return found

    def update(self):
        self.history.append((self.scale, self.found_inf))
        self.skipped += bool(self.found_inf)
        if self.found_inf:
            self.hysteresis_left -= 1
            if self.hysteresis_left > 0:        # within the hysteresis: skip, keep the scale
                self.good_steps = 0
                return
        before = self.scale
        self.scale, self.good_steps = update_scale(
            self.scale, self.good_steps, self.found_inf, self.growth_factor, self.backoff_factor,
            self.growth_interval)
        self.scale = max(self.scale, self.min_scale)
        if self.scale > before:                 # Megatron resets the counter when S grows
            self.hysteresis_left = self.hysteresis

    def state_dict(self):
        return {"scale": np.array(self.scale), "good_steps": np.array(self.good_steps),
                "skipped": np.array(self.skipped), "hysteresis_left": np.array(self.hysteresis_left)}

    def load_state_dict(self, d):
        self.scale, self.good_steps, self.skipped = float(d["scale"]), int(d["good_steps"]), int(d["skipped"])
        self.hysteresis_left = int(d.get("hysteresis_left", self.hysteresis))
