"""Activation recomputation (gradient checkpointing): trade one more forward for memory.

    python -m minidist.lessons.08_activation_recompute
    mpirun -n 2 python -m minidist.lessons.08_activation_recompute --tp 2

`y = checkpoint(fn, *inputs)` runs fn without recording a graph: none of the arrays fn's
ops would save for backward is kept, only the inputs of the checkpoint (one node that
saves them). When backward reaches that node it runs fn again, this time recording,
from the saved inputs, and backpropagates through the graph just rebuilt: the
parameters fn uses get their gradients there (the inner backward adds into their
.grad, hooks included), the inputs get theirs from the node. Chen et al. 2016
(arXiv 1604.06174); Megatron's "full" recomputation checkpoints every layer. Its name
is minidist.recompute.checkpoint (PyTorch's torch.utils.checkpoint); the package
minidist.checkpoint is the other meaning, a run's saved state.

Exact, not approximate: the rerun is the same arithmetic on the same arrays, and dropout
draws the same masks because a DropoutRNG's mask depends on (seed, step, sample, call
counter): the checkpoint notes each DropoutRNG's counter before fn runs, rewinds it
for the rerun, checks the rerun drew as many masks, and puts the counter back.

Composes with every strategy because it only repeats a forward:
- tensor parallelism: fn's f/g collectives run again in the rerun, at the same point of
  the backward on every rank (all ranks walk the same graph), so nothing can cross; a
  checkpointed layer's forward all-reduces (g) are sent twice: 2 more of b*s*h per layer
  and micro-batch (tp_formulas.expected_bytes(recomputed_layers=...));
- pipeline parallelism: the output's backward takes any gradient (a non-scalar one from
  the next stage), and each micro-batch's DropoutRNG keeps its own counter;
- data parallelism / ZeRO: gradients reach the parameters through the ordinary backward.

Policies for a stack of blocks (`Policy`, `run_blocks`), as GPT.set_recompute applies them:
`none`; `full` (each block a checkpoint: keeps L block inputs, rebuilds one block at a
time); `every-k` (a checkpoint per segment of k blocks, k = round(sqrt(L)) by default:
L/k inputs kept plus k blocks rebuilt: (L/k) x + k A, least at k = sqrt(L x / A); Chen
et al.'s sqrt(L) assumes x ~ A. A transformer block's saves A are many times its input
x, yet k = 2 still beats full (L x + A) once L > 2A/x: at x = 2sbh, A = 34sbh, from
L = 35 on. Full keeps the least only for shallower stacks, as in lesson 08); `selective`
(only the attention core, whose b*nh*T*T probabilities and mask are the 5as^2b term of
Korthikanti et al. 2022, arXiv 2205.05198: cheap to rerun, large to keep).
"""
import math

from minidist import ops
from minidist.context import Context
from minidist.plan.rules import segments        # the planner's memory model cuts the same way
from minidist.rng import dropout_rng_of
from minidist.tensor import Function, Node, Tensor, is_grad_enabled, no_grad

# ----------------------------------------------------------------------------- dropout counters


def dropout_counters(inputs):
    """[(rng, calls)] for every DropoutRNG among inputs (also one seen through a SlicedRNG):
    the counter each will have to be rewound to for the rerun."""
    out, seen = [], set()
    for x in inputs:
        x = dropout_rng_of(x)                          # SlicedRNG -> the DropoutRNG it slices
        if x is not None and hasattr(x, "calls") and id(x) not in seen:
            seen.add(id(x))
            out.append((x, x.calls))
    return out

# ----------------------------------------------------------------------------- the two halves


def checkpoint_forward(fn, inputs):
    """Run fn(*inputs) without recording a graph. Returns (output Tensor, counters).

    counters: dropout_counters(inputs) taken before fn runs, so the backward can replay
    the same masks. Nothing fn's ops compute is saved: under no_grad a Context keeps nothing.
    """
    counters = dropout_counters(inputs)
    with no_grad():
        out = fn(*inputs)
    if not isinstance(out, Tensor):
        raise TypeError(f"checkpoint: fn must return one Tensor, not {type(out).__name__}")
    return out, counters


def checkpoint_backward(fn, inputs, counters, grad):
    """Rebuild fn's graph and backpropagate grad through it. Returns one gradient per input.

    inputs: the forward's inputs again, Tensors holding the saved arrays (no graph behind
    them), the rest as they were. Each DropoutRNG is rewound to its counter in `counters`
    so the rerun draws the forward's masks; fn runs on fresh leaves, recording; backward
    from its output with grad puts the parameters' gradients into their .grad and the
    inputs' into the leaves, which are returned (None where there is none).
    """
    now = [(rng, rng.calls) for rng, _ in counters]
    for rng, start in counters:
        rng.calls = start                              # replay: the same masks as the forward
    leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
    out = fn(*leaves)
    for rng, calls in now:
        rng.calls = calls
    if out.requires_grad:
        out.backward(grad)
    return [x.grad if isinstance(x, Tensor) else None for x in leaves]

# ----------------------------------------------------------------------------- the Function


class Checkpoint(Function):
    """One node in place of fn's whole graph: saves fn's Tensor inputs, nothing else.

    Its own apply, because the node must be recorded whenever gradients are on, even when
    no input needs one: fn's parameters do, and reach the engine only in the rerun.
    """

    @classmethod
    def apply(cls, fn, *inputs):
        out, counters = checkpoint_forward(fn, inputs)
        if not is_grad_enabled():
            return out
        needs = tuple(isinstance(t, Tensor) and t.requires_grad for t in inputs)
        params = [t for t, n in zip(inputs, needs) if n and t._node is None]
        ctx = Context(needs, [id(t.data) for t in params], True, params)
        ctx.save_for_backward(*[t.data for t in inputs if isinstance(t, Tensor)])
        ctx.fn, ctx.inputs, ctx.counters = fn, inputs, counters
        node = Node(cls, ctx, tuple(inputs), (out.data,))
        return Tensor._from_node(out.data, node, 0)

    @staticmethod
    def backward(ctx, grad):
        arrays = iter(ctx.saved)
        inputs = [Tensor(next(arrays), requires_grad=t.requires_grad) if isinstance(t, Tensor) else t
                  for t in ctx.inputs]
        ctx.inputs = None                              # the graph in front goes with the node
        before = [rng.calls for rng, _ in ctx.counters]
        grads = checkpoint_backward(ctx.fn, inputs, ctx.counters, grad)
        if [rng.calls for rng, _ in ctx.counters] != before:   # a later forward would draw wrong masks
            raise RuntimeError("checkpoint: the rerun left a DropoutRNG's counter moved; put it back "
                               "where it was before the rerun")
        return tuple(grads)


def checkpoint(fn, *inputs):
    """fn(*inputs) whose activations are recomputed in backward instead of kept.

    inputs: Tensors (saved; gradients flow to those that require grad) and anything else
    fn needs (a DropoutRNG, a flag), passed as it is. fn returns one Tensor.
    """
    return Checkpoint.apply(fn, *inputs)

# ----------------------------------------------------------------------------- policies for a stack of blocks


POLICIES = ("none", "full", "every-k", "selective")


def default_k(n_layer):
    """Chen et al.'s segment length: sqrt(L), rounded (at least 1)."""
    return max(1, round(math.sqrt(n_layer)))


class Policy:
    """Which activations a GPT recomputes. k: the segment length of every-k."""

    def __init__(self, name="none", k=None, n_layer=1):
        if name not in POLICIES:
            raise ValueError(f"unknown recomputation policy {name!r}: choose one of {', '.join(POLICIES)}")
        if k is not None and (int(k) != k or k < 1):
            raise ValueError(f"the segment length k must be a whole number of blocks, at least 1, not {k}")
        self.name = name
        self.k = int(k) if k is not None else default_k(n_layer)

    @property
    def segment(self):
        """Blocks per checkpoint (None: blocks are not checkpointed)."""
        return {"full": 1, "every-k": self.k}.get(self.name)

    def __repr__(self):
        return f"Policy({self.name!r}" + (f", k={self.k})" if self.name == "every-k" else ")")


class _Segment:
    """Blocks lo..hi-1 run one after the other: the fn of one every-k checkpoint."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __call__(self, x, *args):
        for block in self.blocks:
            x = block(x, *args)
        return x


def run_blocks(policy, blocks, x, *args, caches=None):
    """x through the blocks (each called block(x, *args)) as the policy says.

    With a KV cache (generation) or without gradients there is nothing to save, so the
    blocks simply run.
    """
    if caches is not None:
        for block, cache in zip(blocks, caches):
            x = block(x, *args, cache=cache)
        return x
    size = policy.segment if policy is not None else None
    if size is None or not is_grad_enabled():
        for block in blocks:
            x = block(x, *args)
        return x
    blocks = list(blocks)
    for lo, hi in segments(len(blocks), size):
        x = checkpoint(_Segment(blocks[lo:hi]), x, *args)
    return x


def _attention_core(q, k, v, dropout_p, rng):
    return ops.causal_attention(q, k, v, dropout_p=dropout_p, rng=rng)


def attention_core(q, k, v, dropout_p, rng, recompute):
    """The causal attention of (B, nh, T, hs) q, k, v; recompute: a checkpoint around it
    (selective recomputation): keeps q, k, v, not the (B, nh, T, T) probabilities and mask."""
    if recompute and is_grad_enabled():
        return checkpoint(_attention_core, q, k, v, dropout_p, rng)
    return _attention_core(q, k, v, dropout_p, rng)


def set_policy(model, name="none", k=None, blocks=None):
    """Apply a policy to a GPT (or a tensor-parallel one, or a pipeline stage): blocks by
    segments, or the attention cores (selective). blocks: the blocks the model runs
    (default model.transformer.h); every-k's default k is sqrt of their count. Returns
    the Policy; bad values raise ValueError."""
    blocks = list(model.transformer.h if blocks is None else blocks)
    policy = Policy(name, k, len(blocks))
    model.recompute = policy
    for block in blocks:
        block.attn.recompute_core = policy.name == "selective"
    return policy
