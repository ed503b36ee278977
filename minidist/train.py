"""The training loop's pieces that every lesson shares, as nanoGPT's train.py has them:
learning-rate warm-up then cosine decay, one optimizer step over micro-batches with
gradient clipping, and a validation loss.

A parallel strategy changes what happens around backward and before the optimizer step
(data parallelism all-reduces gradients there): `train_step(..., dp=wrapper)` is that slot,
and `train_step(..., raw_grads={})` hands back the gradients that slot produced, before
clipping and the optimizer touch them: what a parallel run is compared on.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from minidist.backend import to_numpy, xp
from minidist.optim import clip_grad_norm
from minidist.parallel.strategy import Strategy
from minidist.rng import DropoutRNG
from minidist.tensor import no_grad


@dataclass
class TrainConfig:
    batch_size: int = 16            # the global batch, in sequences
    max_iters: int = 200
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 20
    lr_decay_iters: Optional[int] = None  # None: decay over max_iters
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0          # 0 turns clipping off
    eval_interval: int = 50
    eval_iters: int = 4
    seed: int = 1337


def get_lr(it, cfg):
    """Linear warm-up for warmup_iters, then cosine decay to min_lr (nanoGPT's schedule)."""
    if it < cfg.warmup_iters:
        return linear_warmup(it, cfg.warmup_iters, cfg.learning_rate)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    return cosine_decay(it - cfg.warmup_iters, decay_iters - cfg.warmup_iters, cfg.learning_rate, cfg.min_lr)


def linear_warmup(it, warmup, peak):
    """The learning rate of warm-up step `it` (0-based) of `warmup`: peak x (it + 1)/(warmup + 1)."""
    return peak * (it + 1) / (warmup + 1)


def cosine_decay(done, length, peak, floor):
    """Cosine from peak (done = 0) to floor (done >= length), `done` and `length` counted
    from the end of the warm-up, in any unit (steps here, tokens in minidist/curriculum.py)."""
    if done >= length:
        return floor
    coeff = 0.5 * (1.0 + math.cos(math.pi * done / max(1, length)))  # 1 -> 0
    return floor + coeff * (peak - floor)


def micro_batches(x, y, step, seed, k=1, first_sample=0):
    """Cut (x, y) into k micro-batches, each with its dropout generator.

    Sample i of the global batch draws its dropout masks from (seed, step, i), whoever
    holds it: `first_sample` is the global index of x's first row.
    """
    rows = np.array_split(np.arange(len(x)), k)
    return [(x[r], y[r], DropoutRNG(seed, step, first_sample + r)) for r in rows]


def micro_batch_scale(k):
    """What each of k micro-batches' losses is multiplied by before its backward: 1/k.

    The k backward passes add their gradients into .grad, so the sum is the gradient of
    the mean loss over the whole batch: the same gradient one big batch gives.
    """
    return 1.0 / k


def train_step(model, optimizer, batches, lr, grad_clip=0.0, dp=None, raw_grads=None, scaler=None):
    """One optimizer step. Returns (mean loss over the micro-batches, grad norm or None).

    batches: [(x, y, rng)] micro-batches; each loss is scaled by micro_batch_scale(k)
    = 1/k so the accumulated gradient is the gradient of the mean loss. dp: a parallel
    strategy (minidist/parallel/strategy.py's Strategy; None: one process): each backward
    runs inside dp.backward_context(last), where it may communicate, and dp.sync() runs
    after the last one, before clipping. Clipping needs the norm of the whole model's
    gradient: a strategy that holds only part of it (tensor parallelism's shards) supplies
    it from grad_norm_sq(held); otherwise (None) the norm of the local gradients is the
    whole one (every data-parallel replica holds the same gradients after sync).

    A pipeline's strategy has owns_schedule = True: its forward_backward(model, batches,
    scale) runs every forward and backward of the step in its schedule's order and returns
    the mean loss (minidist/parallel/pipeline_parallel.py).

    raw_grads: a dict to fill with a copy of every parameter's gradient as it stands
    after dp.sync() and before clipping and the optimizer ({name: array}, None for a
    parameter without one). That is what a parallel run is compared on: clipping
    rescales the gradients to a fixed norm and AdamW divides by their own size, so
    between them a gradient wrong by a constant factor would leave the weights right.

    optimizer.store_grads() runs after the sync (a no-op for optim's optimizers; mixed
    precision's MixedPrecision keeps the gradients in its storage dtype there). `scaler`
    (a GradScaler) multiplies the loss by its scale before backward, divides the gradients
    by it after the sync (raw_grads, clipping and the step see unscaled gradients), and
    skips the step when a gradient overflowed.
    """
    dp = Strategy() if dp is None else dp
    optimizer.zero_grad()
    k, total = len(batches), 0.0
    scale = micro_batch_scale(k) * (scaler.scale if scaler is not None else 1.0)
    if dp.owns_schedule:        # a pipeline runs its micro-batches in its own order
        total = dp.forward_backward(model, batches, scale)
    else:
        losses = []
        for i, (x, y, rng) in enumerate(batches):
            _, loss = model(x, y, rng=rng)
            with dp.backward_context(last=i == k - 1):
                (loss * scale).backward()
            losses.append(loss.data)
        for v in to_numpy(xp.stack(losses)):    # the losses come home together: one copy a step
            total += float(v) / k
    dp.sync()
    # ZeRO keeps each rank's partition of the gradients outside the model: its strategy
    # names the tensors holding them (named_grads)
    named = list(dp.named_grads(model))
    optimizer.store_grads()
    if scaler is not None:
        scaler.unscale_([p for _, p in named])
    if raw_grads is not None:
        for name, p in named:
            raw_grads[name] = None if p.grad is None else xp.array(p.grad)   # a copy
    norm = None
    if grad_clip:       # the norm of the whole model: a sharded model's strategy supplies it
        held = [p for _, p in named]
        norm = clip_grad_norm(held, grad_clip, dp.grad_norm_sq(held))
    optimizer.set_lr(lr)
    if scaler is None or not scaler.found_inf:      # an overflowed step is skipped
        optimizer.step()
    if scaler is not None:
        scaler.update()
    return total, norm


def estimate_loss(model, data, batch_size, iters=4):
    """Mean loss on `iters` fixed batches of each split, in eval mode without a graph."""
    out = {}
    model.eval()
    with no_grad():
        for split in ("train", "val"):
            losses = [model(*data.get_batch(split, batch_size, 10**6 + i))[1].item() for i in range(iters)]
            out[split] = float(np.mean(losses))
    model.train()
    return out
