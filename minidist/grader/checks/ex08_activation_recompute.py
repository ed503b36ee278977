"""Checks for lessons/exercises/08_activation_recompute.py: the two halves of a checkpoint.

Serial, float64, on one GPT block with dropout (three masks per call). Each check plugs
the function to grade into the package's Checkpoint beside the package's other half, so
a student's forward is graded with a correct backward and the other way round:
- 8.1: the output equals the block's; the meter (MEMORY) holds nothing more while the
  output is alive (activations not kept), and its peak while fn ran is where it started
  (a graph recorded and then dropped, Tensor(out.data), FAILS); the counters are the ones before fn ran;
- 8.2: the input's and every parameter's gradient equal the block's without
  recomputation, exactly (same arithmetic, same masks); the DropoutRNG counter is back
  where it was when the backward returns; a non-scalar gradient works.
"""
import contextlib

import numpy as np

from minidist import recompute
from minidist.grader.checks import Exercise
from minidist.model import GPT, GPTConfig
from minidist.rng import DropoutRNG
from minidist.tensor import MEMORY, Tensor

CFG = GPTConfig(block_size=6, vocab_size=16, n_layer=2, n_head=2, n_embd=8, dropout=0.3, dtype="float64")
B = 3


@contextlib.contextmanager
def _plugged(name, fn):
    """The package's Checkpoint with one half replaced by the function under grade."""
    old = getattr(recompute, name)
    setattr(recompute, name, fn)
    try:
        yield
    finally:
        setattr(recompute, name, old)


def _setup(seed=0):
    block = GPT(CFG, seed=seed).transformer.h[0]
    g = np.random.default_rng(seed)
    leaf = Tensor(g.standard_normal((B, CFG.block_size, CFG.n_embd)), requires_grad=True)
    return block, leaf, g.standard_normal((B, CFG.block_size, CFG.n_embd))


def _plain(seed=0):
    """The block without recomputation: output, input gradient, parameter gradients."""
    block, leaf, grad = _setup(seed)
    y = block(leaf.reshape(leaf.shape), DropoutRNG(seed, 0, range(B)))
    y.backward(grad)
    return y.data, leaf.grad, {n: p.grad for n, p in block.named_parameters()}


def _same(what, got, want):
    if got is None:
        raise AssertionError(f"{what} is None; expected an array of shape {want.shape}")
    got = np.asarray(getattr(got, "data", got))
    if got.shape != want.shape:
        raise AssertionError(f"{what} has shape {got.shape}, expected {want.shape}")
    if not np.array_equal(got, want):
        d = np.abs(got - want).max() / max(np.abs(want).max(), 1e-300)
        raise AssertionError(f"{what} differs from the run without recomputation (max_rel_diff {d:.1e}); "
                             f"recomputation reruns the same arithmetic with the same masks, so it must be equal")


def check_checkpoint_forward(fn):
    want_y, want_gx, _ = _plain()
    block, leaf, grad = _setup()
    rng = DropoutRNG(0, 0, range(B))
    x = leaf.reshape(leaf.shape)
    before = MEMORY.live_bytes
    MEMORY.reset_peak()
    result = fn(block, [x, rng])
    during = MEMORY.peak_bytes - before
    if not isinstance(result, tuple) or len(result) != 2:
        raise AssertionError("return (output Tensor, counters)")
    out, counters = result
    _same("the output", out, want_y)
    kept = MEMORY.live_bytes - before
    if during and not kept:
        raise AssertionError(f"while fn ran, its ops saved up to {during} bytes of activations for a backward (the "
                             f"graph was recorded, then dropped): run fn under no_grad(), so that they save nothing")
    if kept:
        raise AssertionError(f"the forward keeps {kept} bytes of activations while its output is alive: run fn "
                             f"under no_grad(), so that its ops save nothing")
    if [(id(r), c) for r, c in counters] != [(id(rng), 0)]:
        raise AssertionError(f"counters should be [(the DropoutRNG, 0)], its counter before fn ran (fn moved it "
                             f"to {rng.calls}); got {[(type(r).__name__, c) for r, c in counters]}")
    del out
    with _plugged("checkpoint_forward", fn):
        y = recompute.checkpoint(block, leaf.reshape(leaf.shape), DropoutRNG(0, 0, range(B)))
    y.backward(grad)
    _same("the input's gradient (your forward, the package's backward)", leaf.grad, want_gx)


def check_checkpoint_backward(fn):
    want_y, want_gx, want_gp = _plain()
    block, leaf, grad = _setup()
    rng = DropoutRNG(0, 0, range(B))
    def one_per_input(fn_, inputs, counters, grad_):
        out = fn(fn_, inputs, counters, grad_)
        if not isinstance(out, (list, tuple)) or len(out) != len(inputs):
            raise AssertionError(f"checkpoint_backward returned {type(out).__name__}"
                                 + (f" of {len(out)}" if hasattr(out, "__len__") else "")
                                 + f" for {len(inputs)} inputs: return one gradient per input, None for "
                                 "an input that is not a Tensor (the rng here)")
        return out

    with _plugged("checkpoint_backward", one_per_input):
        y = recompute.checkpoint(block, leaf.reshape(leaf.shape), rng)
        rng.calls += 4                     # the layers after this block draw their masks too
        calls = rng.calls
        _same("the output", y, want_y)
        try:
            y.backward(grad)
        except RuntimeError as e:
            if "counter" in str(e):
                raise AssertionError(f"after your backward the DropoutRNG's counter is not where it was before it "
                                     f"({calls}): put the counters back after the rerun")
            raise
    _same("the input's gradient", leaf.grad, want_gx)
    for name, p in block.named_parameters():
        _same(f"the gradient of {name}", p.grad, want_gp[name])
    if rng.calls != calls:
        raise AssertionError(f"the DropoutRNG's counter is {rng.calls} after your backward, {calls} before")


EXERCISES = [
    Exercise("8.1", "checkpoint_forward", recompute.checkpoint_forward, check_checkpoint_forward),
    Exercise("8.2", "checkpoint_backward", recompute.checkpoint_backward, check_checkpoint_backward),
]
