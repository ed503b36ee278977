"""The training loop's pieces that every lesson shares, as nanoGPT's train.py has them:
learning-rate warm-up then cosine decay, one optimizer step over micro-batches with
gradient clipping, and a validation loss.

A parallel strategy changes what happens around backward and before the optimizer step
(data parallelism all-reduces gradients there): `train_step(..., dp=wrapper)` is that slot.
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from minidist.optim import clip_grad_norm
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
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def micro_batches(x, y, step, seed, k=1, first_sample=0):
    """Cut (x, y) into k micro-batches, each with its dropout generator.

    Sample i of the global batch draws its dropout masks from (seed, step, i), whoever
    holds it: `first_sample` is the global index of x's first row.
    """
    rows = np.array_split(np.arange(len(x)), k)
    return [(x[r], y[r], DropoutRNG(seed, step, first_sample + r)) for r in rows]


def train_step(model, optimizer, batches, lr, grad_clip=0.0, dp=None):
    """One optimizer step. Returns (mean loss over the micro-batches, grad norm or None).

    batches: [(x, y, rng)] micro-batches; each loss is scaled by 1/k so the accumulated
    gradient is the gradient of the mean loss. dp: a gradient synchroniser (see
    minidist/parallel/data_parallel.py): each backward runs inside
    dp.backward_context(last), where it may communicate, and dp.sync() runs after the
    last one, before clipping.
    """
    params = list(model.parameters())
    optimizer.zero_grad()
    k, total = len(batches), 0.0
    for i, (x, y, rng) in enumerate(batches):
        _, loss = model(x, y, rng=rng)
        with dp.backward_context(last=i == k - 1) if dp is not None else contextlib.nullcontext():
            (loss * (1.0 / k)).backward()
        total += loss.item() / k
    if dp is not None:
        dp.sync()
    norm = clip_grad_norm(params, grad_clip) if grad_clip else None
    optimizer.set_lr(lr)
    optimizer.step()
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
