"""Checks for lessons/exercises/08_activation_recompute.py: the two halves of a checkpoint.

Serial, float64, on a chain of three GPT blocks with dropout (three masks per block),
one DropoutRNG whose counter starts at 5, not 0 (a counter written as 0, or rewound to 0,
would otherwise be right by chance). The check's DropoutRNG notes the counter of every
mask it draws, so a rerun that draws other masks than its forward is named as such.
Each check plugs the function to grade into the package's Checkpoint beside the
package's other half, so a student's forward is graded with a correct backward and the
other way round:
- 8.1: called once per block, each block's output the next one's input: every output
  equals the block's (and stays so after the later calls); the meter (MEMORY) holds
  nothing more while the output is alive (activations not kept), and its peak while fn
  ran is where it started (a graph recorded and then dropped, Tensor(out.data), FAILS);
  the counters returned are the ones before fn ran; the DropoutRNG's counter after the
  call is where fn left it (the next block draws after it). Then the three blocks as
  checkpoints, with the package's backward: the gradients must be exact.
- 8.2: the three blocks as checkpoints (the package's forward), 4 more masks drawn
  after them (the layers that follow), then backward with a non-scalar gradient: your
  backward is called three times, last block first. It must return one gradient per
  input, one for the Tensor that requires grad; each rerun must draw its forward's
  masks; the counter must be back where it was after each call; the input's and every
  parameter's gradient must equal the blocks' without recomputation, exactly. Every
  parameter already holds a gradient when this backward starts (earlier micro-batches'):
  the backward adds to it, so one that clears .grad before its rerun FAILs.

The expected values (the blocks run without recomputation) are computed only after the
function under grade has returned. An AssertionError raised by the student's own code
is reported as such.
"""
import contextlib

import numpy as np

from minidist import recompute
from minidist.grader.checks import Exercise, yours as _yours
from minidist.grader.plugin import Run
from minidist.model import GPT, GPTConfig
from minidist.rng import DropoutRNG
from minidist.tensor import MEMORY, Tensor

CFG = GPTConfig(block_size=6, vocab_size=16, n_layer=3, n_head=2, n_embd=8, dropout=0.3, dtype="float64")
B = 3
START = 5            # the DropoutRNG's counter when the first block starts: the layers before drew 5 masks
AFTER = 4            # masks the layers after the blocks draw between forward and backward


class NotingRNG(DropoutRNG):
    """A DropoutRNG that notes the counter of every mask it draws."""

    def __init__(self, *args):
        super().__init__(*args)
        self.drawn = []

    def mask(self, shape, p, dtype):
        self.drawn.append(self.calls)
        return super().mask(shape, p, dtype)


@contextlib.contextmanager
def _plugged(name, fn):
    """The package's Checkpoint with one half replaced by the function under grade."""
    old = getattr(recompute, name)
    setattr(recompute, name, fn)
    try:
        yield
    finally:
        setattr(recompute, name, old)


def _setup(seed=0, accumulated=False):
    """The blocks, the input leaf, the gradient of the last output, a DropoutRNG at START.
    accumulated: every parameter already holds a gradient, as after earlier micro-batches
    (a backward adds to it; one that starts from None would pass without this)."""
    blocks = list(GPT(CFG, seed=seed).transformer.h)
    g = np.random.default_rng(seed)
    leaf = Tensor(g.standard_normal((B, CFG.block_size, CFG.n_embd)), requires_grad=True)
    rng = NotingRNG(seed, 0, range(B))
    rng.calls = START
    grad = g.standard_normal((B, CFG.block_size, CFG.n_embd))
    if accumulated:
        earlier = np.random.default_rng([seed, 1])
        for _, p in _params(blocks):
            p.grad = earlier.standard_normal(p.shape)
    return blocks, leaf, grad, rng


def _params(blocks):
    return [(f"h.{i}.{n}", p) for i, b in enumerate(blocks) for n, p in b.named_parameters()]


def _plain(seed=0, accumulated=False):
    """The blocks without recomputation: each block's output, the masks each drew, the
    input's gradient, the parameters' gradients. Computed after the student's code ran."""
    blocks, leaf, grad, rng = _setup(seed, accumulated)
    x, outs, masks = leaf.reshape(leaf.shape), [], []
    for block in blocks:
        mark = len(rng.drawn)
        x = block(x, rng)
        outs.append(x.data)
        masks.append(rng.drawn[mark:])
    x.backward(grad)
    return outs, masks, leaf.grad, {n: p.grad for n, p in _params(blocks)}


def _same(what, got, want, hint="recomputation reruns the same arithmetic with the same masks, so it must be equal"):
    if got is None:
        raise AssertionError(f"{what} is None; expected an array of shape {want.shape}")
    got = np.asarray(getattr(got, "data", got))
    if got.shape != want.shape:
        raise AssertionError(f"{what} has shape {got.shape}, expected {want.shape}")
    if not np.array_equal(got, want):
        d = np.abs(got - want).max() / max(np.abs(want).max(), 1e-300)
        raise AssertionError(f"{what} differs from the run without recomputation (max_rel_diff {d:.1e}); {hint}")


def _ks(ks):
    return ", ".join(map(str, ks)) if ks else "none"


def check_checkpoint_forward(fn):
    blocks, leaf, grad, rng = _setup()
    x = leaf.reshape(leaf.shape)
    seen = []                       # per block: (output Tensor, its values then, counters, counter before, after)
    for i, block in enumerate(blocks):
        start = rng.calls
        before = MEMORY.live_bytes
        MEMORY.reset_peak()
        result = _yours(fn, block, [x, rng])
        during = MEMORY.peak_bytes - before
        after = rng.calls
        if not isinstance(result, tuple) or len(result) != 2:
            raise AssertionError(f"checkpoint_forward returned {type(result).__name__}: return (output Tensor, "
                                 "counters)")
        out, counters = result
        if not isinstance(out, Tensor):
            raise AssertionError(f"checkpoint_forward returned ({type(out).__name__}, ...): the output is the Tensor "
                                 "fn returned")
        kept = MEMORY.live_bytes - before
        if during and not kept:
            raise AssertionError(f"while fn ran, its ops saved up to {during} bytes of activations for a backward "
                                 f"(the graph was recorded, then dropped): run fn under no_grad(), so that they "
                                 "save nothing")
        if kept:
            raise AssertionError(f"the forward keeps {kept} bytes of activations while its output is alive: run fn "
                                 f"under no_grad(), so that its ops save nothing")
        try:
            pairs = [(r, c) for r, c in counters]
        except (TypeError, ValueError):
            raise AssertionError(f"checkpoint_forward returned counters {counters!r}: a list of (rng, counter) "
                                 "pairs, dropout_counters(inputs)") from None
        if [(id(r), c) for r, c in pairs] != [(id(rng), start)]:
            raise AssertionError(f"block {i} (the DropoutRNG's counter at {start} when it started): counters should "
                                 f"be [(the DropoutRNG, {start})], its counter before fn ran; got "
                                 f"{[(type(r).__name__, c) for r, c in pairs]} (take dropout_counters(inputs) "
                                 "before fn runs)")
        seen.append((out, out.data.copy(), start, after))
        x = out
    # what the blocks give without recomputation, now that fn has returned for the last time
    outs, masks, want_gx, want_gp = _plain()
    for i, ((out, then, start, after), want, drawn) in enumerate(zip(seen, outs, masks)):
        if after != start + len(drawn):
            raise AssertionError(f"after your checkpoint_forward of block {i} the DropoutRNG's counter is {after}; fn "
                                 f"drew {len(drawn)} masks from {start}, so it must stay at {start + len(drawn)}, "
                                 "where fn left it: the next layers draw their masks after it (only the backward "
                                 "rewinds it, for its rerun, and puts it back)")
        _same(f"the output of block {i}", then, want, "the forward runs fn as it is, with the masks it draws")
        if not np.array_equal(out.data, then):
            raise AssertionError(f"the output of block {i} changed when checkpoint_forward was called again for the "
                                 "next block: return fn's own output, not a buffer reused")
    seen = outs = None
    # the three blocks as checkpoints: your forward, the package's backward
    blocks, leaf, grad, rng = _setup()
    with _plugged("checkpoint_forward", fn):
        y = leaf.reshape(leaf.shape)
        for block in blocks:
            y = recompute.checkpoint(block, y, rng)
    rng.calls += AFTER
    y.backward(grad)
    _same("the input's gradient (your forward, the package's backward, three blocks)", leaf.grad, want_gx)
    for name, p in _params(blocks):
        _same(f"the gradient of {name} (your forward, the package's backward)", p.grad, want_gp[name])


def check_checkpoint_backward(fn):
    blocks, leaf, grad, rng = _setup(accumulated=True)
    index = {id(b): i for i, b in enumerate(blocks)}
    forward_drawn, reruns, returned = {}, [], []

    def one_per_input(fn_, inputs, counters, grad_):
        i = index.get(id(fn_))
        before, mark = rng.calls, len(rng.drawn)
        out = _yours(fn, fn_, inputs, counters, grad_)
        reruns.append((i, rng.drawn[mark:], before, rng.calls))
        if not isinstance(out, (list, tuple)) or len(out) != len(inputs):
            raise AssertionError(f"checkpoint_backward returned {type(out).__name__}"
                                 + (f" of {len(out)}" if hasattr(out, "__len__") else "")
                                 + f" for {len(inputs)} inputs: return one gradient per input, None for "
                                 "an input that is not a Tensor (the rng here)")
        for k, (x, g) in enumerate(zip(inputs, out)):
            if isinstance(x, Tensor) and x.requires_grad and g is None:
                raise AssertionError(f"checkpoint_backward of block {i} returned None as the gradient of input {k}, "
                                     "a Tensor that requires grad (the block's input): make its leaf with "
                                     "Tensor(x.data, requires_grad=x.requires_grad), run fn on the leaves, and "
                                     "return each leaf's .grad after out.backward(grad)")
            if isinstance(x, Tensor) and g is not None and np.shape(getattr(g, "data", g)) != x.shape:
                raise AssertionError(f"checkpoint_backward of block {i} returned a gradient of shape "
                                     f"{np.shape(getattr(g, 'data', g))} for input {k} of shape {x.shape}: return "
                                     "the leaves' gradients, one per input")
        returned.append((out, [None if g is None else np.array(getattr(g, "data", g)) for g in out]))
        return out

    with _plugged("checkpoint_backward", one_per_input):
        y = leaf.reshape(leaf.shape)
        for i, block in enumerate(blocks):
            mark = len(rng.drawn)
            y = recompute.checkpoint(block, y, rng)
            forward_drawn[i] = rng.drawn[mark:]
        rng.calls += AFTER                 # the layers after these blocks draw their masks too
        calls = rng.calls
        try:
            y.backward(grad)
        except RuntimeError as e:
            if "counter" in str(e):
                raise AssertionError(f"after your backward the DropoutRNG's counter is not where it was before it "
                                     f"({calls}): put the counters back after the rerun") from None
            raise
    if len(reruns) != len(blocks):
        raise AssertionError(f"checkpoint_backward ran {len(reruns)} times for {len(blocks)} checkpointed blocks")
    if rng.calls != calls:
        raise AssertionError(f"the DropoutRNG's counter is {rng.calls} after your backward, {calls} before")
    for out, then in returned:             # the gradients returned earlier: as they were
        for g, was in zip(out, then):
            if was is not None and not np.array_equal(np.asarray(getattr(g, "data", g)), was):
                raise AssertionError("a gradient checkpoint_backward returned changed when it was called again for "
                                     "the block before: return the leaves' own .grad, not a buffer reused")
    # what the blocks give without recomputation, now that fn has returned for the last time
    outs, masks, want_gx, want_gp = _plain(accumulated=True)
    bad = [(i, drawn, forward_drawn[i]) for i, drawn, _, _ in reruns if drawn != forward_drawn.get(i)]
    if bad:
        i, drawn, want = bad[0]
        zero = " (you rewound to 0)" if drawn and drawn[0] == 0 else ""
        masks_said = (f"the rerun of block {i} drew dropout masks {_ks(drawn)} where its forward drew {_ks(want)}"
                      f"{zero}: before the rerun, set each rng's counter to the one in `counters` (the forward's "
                      f"start, {want[0] if want else '?'}), not to 0 and not left where it is")
    else:
        masks_said = ("every rerun drew its forward's masks, so the rerun's arithmetic or the gradient returned "
                      "differs: run fn on fresh leaves, backpropagate `grad` from its output, return the leaves' .grad")
    _same("the input's gradient", leaf.grad, want_gx, masks_said)
    _, _, _, fresh = _plain()              # the same blocks, their parameters' .grad starting at None
    for name, p in _params(blocks):
        got = np.asarray(getattr(p.grad, "data", p.grad)) if p.grad is not None else None
        if got is not None and got.shape == fresh[name].shape and np.array_equal(got, fresh[name]) \
                and not np.array_equal(got, want_gp[name]):
            raise AssertionError(f"the gradient of {name} is this backward's alone: it held a gradient from earlier "
                                 "micro-batches, which your checkpoint_backward wiped (p.grad = None, or "
                                 "zero_grad, before the rerun?); backward adds to .grad, and only the optimizer's "
                                 "zero_grad clears it, once per step")
        _same(f"the gradient of {name} (it held earlier micro-batches' gradients: the backward adds to them)",
              p.grad, want_gp[name], masks_said)


# Lesson 08 with your half of the checkpoint, in one process: every policy (none, full,
# every-k, selective: the attention core is a checkpoint of its own) with dropout, compared
# with none. (Not --tp 2: exercise 08 is graded serially, and a run on 2 ranks would FAIL
# every serial grading.)
SMALL = ("--n-layer", "3", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--batch-size", "2",
         "--steps", "1", "--sweep", "2")
RUNS = (Run("08_activation_recompute", SMALL, ranks=1, together=True),)   # forward's counters -> backward

EXERCISES = [
    Exercise("8.1", "checkpoint_forward", recompute.checkpoint_forward, check_checkpoint_forward, runs=RUNS),
    Exercise("8.2", "checkpoint_backward", recompute.checkpoint_backward, check_checkpoint_backward, runs=RUNS),
]
