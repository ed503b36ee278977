"""Mixture of experts: a router sends each token to top_k of E expert MLPs.

    python -c "from minidist.model import GPT, GPTConfig; m = GPT(GPTConfig(n_expert=4)); print(m.moe_stats())"

One MoE layer replaces a block's MLP (GPTConfig.moe_every says which blocks). For the
tokens of one group (GShard's and Switch's "group": the unit capacity is counted in):

    logits = x @ W_router                       (T, E)   no bias
    probs  = softmax(logits)                    (T, E)   the gates
    experts, keep = select(probs, top_k, capacity, policy)   top-k, then capacity (NumPy, no grad)
    w      = combine_weights(probs, ...)        (T, k)   top-2 renormalised (GShard), dropped -> 0
    y[t]   = sum_j w[t, j] * expert_{experts[t, j]}(x[t])

- capacity per expert and group = ceil(tokens_in_group * top_k / E * capacity_factor)
  (Switch Transformer section 2, times top_k); None: dropless, every choice kept.
- an expert over capacity drops choices by one of two policies (DROP_POLICIES):
  "position" (the default, as the papers): GShard's order (Algorithm 1; DeepSpeed's
  top2gating: locations2 += sum(mask1)): every token's first choice in token order, then
  every second choice; for top-1 that is Switch's cumulative order. (DeepSpeed's
  top1gating instead keeps a random capacity of the tokens: use_rts, on by default.)
  "probs": after Megatron-Core's --moe-token-drop-policy probs (moe_utils.py,
  apply_router_token_dropping: a torch.topk over the tokens with no tie order, ranking by
  the renormalised top-k weight by default); this project ranks by the router's softmax
  probability for that expert (Megatron's ranking with --moe-router-pre-softmax), ties
  by lower token index.
  A dropped token gets 0 from that expert, so with both choices dropped it passes
  through the block's residual only.
- load balancing (Switch section 2): alpha * E * sum_i f_i * P_i, f_i the fraction of
  the group's routing choices (all k, before dropping: Megatron's count; GShard and
  DeepSpeed count first choices only) that picked expert i, P_i the mean probability
  of expert i; it is alpha when routing is perfectly uniform.
- under mixed precision the router's product runs in fp32 (RouterMatMul), as DeepSpeed's
  TopKGate and Megatron's --moe-router-dtype fp32 do; the experts' products are 16-bit.
- router z-loss (ST-MoE section 3): coef * mean over tokens of logsumexp(logits)^2.
Both are per group; the layer's aux loss is their mean over groups, so that under
expert parallelism (each rank's tokens one group) the data-parallel average of each
rank's aux loss is the same number.

On a device (MINIDIST_DEVICE=cuda, or the strict double), per group: the gates come home
in one counted copy (T x E values: the routing above runs on the host, in NumPy) and the
routing goes back in four small ones (each token's experts and kept choices for the
combine weights, the kept rows' (token, choice) pairs in expert order: `kept_rows`, the
balance loss's fractions f); every other array stays on the device. The routing decides
shapes (the rows each expert gets), and shapes are read on the host anyway: Megatron-Core
routes on the GPU but copies its tokens-per-expert counts to the CPU for the all-to-all's
splits (token_dispatcher.py, MoEAlltoAllTokenDispatcher). Routing on the host is this
project's choice.

Gradients flow to the router through the combine weights and the aux losses, to the
experts and to the input through the expert MLPs; the selection (which expert, which
token dropped) is a constant, as in every MoE implementation.

Dropout: applied once to the combined output (B, T, C), where the dense MLP applies it
to its output, with the same DropoutRNG call. Not inside each expert: the mask then
depends only on (sample, position), so expert parallelism draws the same mask as the
single process wherever the expert runs.

Fedus, Zoph, Shazeer (2021), Switch Transformers, arXiv 2101.03961; Lepikhin et al.
(2020), GShard, arXiv 2006.16668; Zoph et al. (2022), ST-MoE, arXiv 2202.08906.
"""
import math

import numpy

from minidist import ops
from minidist.backend import dtype_of, on_device, to_device, to_numpy, xp
from minidist.nn import Dropout, Linear, Module, Parameter
from minidist.tensor import Function, Tensor

# ----------------------------------------------------------------------------- routing (NumPy, no gradient)


def expert_capacity(tokens, top_k, n_expert, capacity_factor):
    """ceil(tokens * top_k / n_expert * capacity_factor): how many routing choices each
    expert accepts from one group; None when capacity_factor is None (dropless)."""
    if capacity_factor is None:
        return None
    exact = tokens * top_k / n_expert * capacity_factor
    return math.ceil(round(exact, 9))          # round: 5.000000000001 from float noise is 5, not 6


def route(probs, top_k, capacity):
    """Which experts each token goes to, and which of those choices fit in capacity.

    probs: (T, E) NumPy array, one group's gates. Returns (experts, keep):
    experts (T, top_k) int64: each token's top_k experts, highest probability first,
        ties broken by the lower expert index (a stable sort), so every rank agrees;
    keep (T, top_k) bool: False where the choice was dropped. Each expert takes at most
        `capacity` choices, counting all k choices of all tokens, keeping the highest
        probabilities for it, ties by the lower token index. capacity None: all True.
    This is the "probs" drop policy (after Megatron-Core's; ranked by the softmax
    probability, as Megatron ranks with --moe-router-pre-softmax, ties as defined here);
    route_by_position is the papers' "position" policy, the default of MoEMLP.
    """
    probs = numpy.asarray(probs)
    T, E = probs.shape
    experts = numpy.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(numpy.int64)
    keep = numpy.ones((T, top_k), dtype=bool)
    if capacity is None:
        return experts, keep
    for e in range(E):
        tok, slot = numpy.nonzero(experts == e)             # every choice of expert e
        p = probs[tok, e]
        order = numpy.lexsort((tok, -p))                     # by probability down, then token up
        dropped = order[capacity:]
        keep[tok[dropped], slot[dropped]] = False
    return experts, keep


def route_by_position(probs, top_k, capacity):
    """route's (experts, keep), with the "position" drop policy: each expert accepts choices
    in GShard's order (Lepikhin et al. 2020, Algorithm 1; DeepSpeed's top2gating) until
    it is full: first the first choices of tokens 0, 1, ..., T-1, then their second
    choices. For top-1 it is Switch's cumulative order. Whether a token's first choice is
    kept depends only on the tokens before it in the group; a second choice waits for
    every first choice, later tokens' too. The experts come from route(probs, top_k, None).
    """
    experts, keep = route(probs, top_k, None)                # (T, k) each; keep all True
    if capacity is None:
        return experts, keep
    slot_major = numpy.asarray(experts).T.ravel()            # slot 0 of every token, then slot 1
    kept = numpy.ones(slot_major.shape, dtype=bool)
    for e in numpy.unique(slot_major):
        (where,) = numpy.nonzero(slot_major == e)            # in GShard's order
        kept[where[capacity:]] = False
    return experts, kept.reshape(top_k, -1).T.copy()


def kept_rows(experts, keep, n_expert):
    """The kept choices as rows, ordered by expert, then token, then choice (host arrays):
    (tok, slot, per_expert): the token and the choice of each row, and how many rows each
    expert gets (E,); expert e's rows are [sum(per_expert[:e]), sum(per_expert[:e+1]))."""
    chosen = [numpy.nonzero((experts == e) & keep) for e in range(n_expert)]
    per_expert = numpy.array([len(t) for t, _ in chosen], numpy.int64)
    tok = numpy.concatenate([t for t, _ in chosen]).astype(numpy.int64)
    slot = numpy.concatenate([s for _, s in chosen]).astype(numpy.int64)
    return tok, slot, per_expert


DROP_POLICIES = ("position", "probs")


def select(probs, top_k, capacity, policy="position"):
    """(experts, keep) of one group under a drop policy: "position" (the papers' order,
    route_by_position) or "probs" (the highest probabilities kept, route)."""
    if policy == "position":
        return route_by_position(probs, top_k, capacity)
    if policy == "probs":
        return route(probs, top_k, capacity)
    raise ValueError(f"drop policy must be one of {DROP_POLICIES}, not {policy!r}")


def set_drop_policy(model, policy):
    """Set the drop policy of every MoE layer of `model` (a GPT); returns the model."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"drop policy must be one of {DROP_POLICIES}, not {policy!r}")
    for _, m in model.moe_layers():
        m.drop_policy = policy
    return model

# ----------------------------------------------------------------------------- the Functions MoE needs


class LogSumExp(Function):
    """log(sum_j exp(x_j)) over the last axis; backward: grad * softmax(x)."""

    @staticmethod
    def forward(ctx, x):
        m = x.max(axis=-1, keepdims=True)
        s = xp.exp(x - m)
        out = m[..., 0] + xp.log(s.sum(axis=-1))
        s /= s.sum(axis=-1, keepdims=True)                   # softmax, for the backward
        ctx.save_for_backward(s)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[..., None] * ctx.saved[0]


class ScatterAddRows(Function):
    """out (n_rows, C) zeros, then out[index[i]] += rows[i]: the combine step puts each
    expert's output rows back at their tokens (a token with two experts gets both).
    Backward: each row's gradient is the gradient of the token it went to, grad[index]."""

    @staticmethod
    def forward(ctx, rows, index, n_rows):
        ctx.index = index
        out = xp.zeros((n_rows,) + rows.shape[1:], rows.dtype)
        xp.add.at(out, index, rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.index]


class RouterMatMul(ops.MatMul):
    """The router's x @ W_r: MatMul's arithmetic, but not in the autocast rule's 16-bit list
    (minidist/precision.py), so under mixed precision it multiplies in fp32 what it is
    given. Why: the softmax and the top-k read these logits; rounded to 16 bits, near-ties
    flip and routing changes (DeepSpeed's TopKGate casts its input and gate weight to
    fp32; Megatron-Core offers --moe-router-dtype fp32). The weight holds the 16-bit value
    MixedPrecision rounds every weight to, as Megatron's bf16 parameter does; DeepSpeed
    keeps the gate's weight itself in fp32 (self.wg.float()), a step not taken here."""


def logsumexp(x):
    return LogSumExp.apply(x)


def scatter_add_rows(rows, index, n_rows):
    return ScatterAddRows.apply(rows, index=_device(index), n_rows=n_rows)

# ----------------------------------------------------------------------------- the differentiable pieces


def gates(x2d, router_weight):
    """x2d (T, C) Tensor, router_weight (C, E) -> (probs, logits), both (T, E) Tensors."""
    logits = RouterMatMul.apply(x2d, router_weight)          # (T, E), fp32 under mixed precision
    return ops.softmax(logits, axis=-1), logits


def combine_weights(probs, experts, keep, top_k):
    """The weight of each token's j-th expert output: a (T, top_k) Tensor.

    top_k = 1: the gate probability itself (Switch). top_k = 2: the two chosen
    probabilities renormalised to sum to 1 (GShard), over both chosen experts, before
    any is dropped: a dropped choice keeps its share of the normalisation and its weight
    then becomes 0, so a token with one choice dropped gets w < 1 from the other.
    """
    T = experts.shape[0]
    experts, keep = _device(experts), _device(keep)          # host routing: one copy each
    picked = probs[xp.arange(T)[:, None], experts]           # (T, k) the chosen gates
    if top_k > 1:
        picked = picked / picked.sum(axis=1, keepdims=True)
    return picked * Tensor(keep.astype(probs.dtype))


def _device(a):
    """a on the device: a counted copy of host data (none for a device array, or on the CPU)."""
    return a if on_device(a) else to_device(a)


def expert_mlp(x_rows, e, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias):
    """Expert e, the dense MLP's c_fc -> GELU -> c_proj, on x_rows (n, C) -> (n, C).

    The weights are the stacked (E, ...) Parameters; [e] picks one expert's slice (its
    gradient lands in that slice of the stacked gradient). Biases may be None (bias=False).
    """
    h = ops.linear(x_rows, c_fc_weight[e], None if c_fc_bias is None else c_fc_bias[e])      # (n, 4C)
    h = ops.gelu(h)
    return ops.linear(h, c_proj_weight[e], None if c_proj_bias is None else c_proj_bias[e])  # (n, C)


def balance_loss(probs, experts, n_expert, top_k, alpha=1.0):
    """Switch's load-balancing loss of one group: alpha * E * sum_i f_i * P_i.

    f_i: fraction of the group's T * top_k routing choices (before dropping) that chose
    expert i, a constant; P_i: mean of probs[:, i] over the group's tokens, differentiable.
    With alpha = 1 it is 1 for perfectly uniform routing (f_i = P_i = 1/E).
    Counting all k choices over T k is Megatron-Core's (switch_load_balancing_loss_func,
    tokens_per_expert from the whole top-k routing map); GShard (Algorithm 1, from mask1)
    and DeepSpeed (top2gating: ce = mean(mask1)) count each token's first choice only,
    over T. The two agree for top-1.
    """
    counts = numpy.bincount(numpy.asarray(experts).ravel(), minlength=n_expert)
    f = counts / (experts.shape[0] * top_k)                  # (E,)
    P = probs.mean(axis=0)                                   # (E,)
    return (P * Tensor(to_device(f, dtype=probs.dtype))).sum() * (alpha * n_expert)


def z_loss(logits, coef=1.0):
    """ST-MoE's router z-loss of one group: coef * mean over tokens of logsumexp(logits)^2."""
    lse = logsumexp(logits)                                  # (T,)
    return (lse * lse).mean() * coef

# ----------------------------------------------------------------------------- the layer


class StackedLinear(Module):
    """E linear layers in one Parameter: weight (E, in, out), bias (E, out). N(0, 0.02)
    weights and zero biases per expert, like nn.Linear; inside a GPT, GPT._init_weights
    draws them again from the model's seed, as it does the dense MLP's."""

    def __init__(self, n_expert, in_features, out_features, bias=True, dtype="float32", rng=None):
        dt = dtype_of(dtype)
        rng = rng if rng is not None else numpy.random.default_rng(0)
        w = rng.normal(0.0, 0.02, size=(n_expert, in_features, out_features))
        self.weight = Parameter(to_device(w, dtype=dt))
        self.bias = Parameter(xp.zeros((n_expert, out_features), dt)) if bias else None


class MoEMLP(Module):
    """A block's MLP as E experts behind a top-k router (see the module docstring).

    After each forward, self.aux holds: balance and z (Tensors, alpha and the z coefficient
    applied, mean over groups), tokens_per_expert (E,) ints (choices each expert processed,
    after capacity, summed over groups), routed_per_expert (E,) (choices before capacity)
    and dropped (int: choices dropped).
    """

    def __init__(self, config):
        E, C = config.n_expert, config.n_embd
        self.router = Linear(C, E, bias=False, dtype=config.dtype)
        self.c_fc = StackedLinear(E, C, 4 * C, bias=config.bias, dtype=config.dtype)
        self.c_proj = StackedLinear(E, 4 * C, C, bias=config.bias, dtype=config.dtype)
        self.dropout = Dropout(config.dropout)
        self.n_expert, self.top_k = E, config.top_k
        self.capacity_factor, self.n_groups = config.capacity_factor, config.moe_groups
        self.alpha, self.z_coef = config.moe_alpha, config.moe_z
        self.drop_policy = "position"               # or "probs": set_drop_policy(model, ...)
        self.aux = None

    def expert(self, x_rows, e):
        """Expert e on x_rows (n, C) -> (n, C)."""
        return expert_mlp(x_rows, e, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)

    def forward(self, x, rng=None, n_groups=None):
        """x (B, T, C) -> y (B, T, C). n_groups: how many contiguous groups the B*T tokens
        are routed in (group g = batch rows g*B/n_groups ... (g+1)*B/n_groups - 1);
        None: the config's moe_groups."""
        B, T, C = x.shape
        G = self.n_groups if n_groups is None else n_groups
        if G < 1 or B % G:
            raise ValueError(f"MoE routes the batch in n_groups contiguous groups of whole rows: "
                             f"batch size {B} is not divisible by n_groups={G}")
        n = B // G * T                                                 # tokens per group
        x2 = x.reshape(B * T, C)                                       # (B*T, C)
        ys, balance, z = [], 0.0, 0.0
        tokens = numpy.zeros(self.n_expert, numpy.int64)
        routed = numpy.zeros(self.n_expert, numpy.int64)
        for g in range(G):
            xg = x2[g * n:(g + 1) * n]                                 # (n, C) this group's tokens
            y, stats = self.route_group(xg)
            ys.append(y)
            balance = balance + stats["balance"]
            z = z + stats["z"]
            tokens += stats["tokens_per_expert"]
            routed += stats["routed_per_expert"]
        y = ys[0] if G == 1 else ops.concat(ys, axis=0)                # (B*T, C)
        self.aux = dict(balance=balance / G, z=z / G, tokens_per_expert=tokens,
                        routed_per_expert=routed, dropped=int(routed.sum() - tokens.sum()))
        return self.dropout(y.reshape(B, T, C), rng)

    def route_group(self, xg):
        """One group's tokens xg (n, C) -> (y (n, C), stats): route, run the experts, combine."""
        n = xg.shape[0]
        E, k = self.n_expert, self.top_k
        probs, logits = gates(xg, self.router.weight)                  # (n, E) each
        capacity = expert_capacity(n, k, E, self.capacity_factor)
        experts, keep = select(to_numpy(probs.data), k, capacity, self.drop_policy)   # (n, k), NumPy
        w = combine_weights(probs, experts, keep, k)                   # (n, k)
        tok, slot, per_expert = kept_rows(experts, keep, E)            # host: rows by expert
        ends = numpy.cumsum(per_expert).tolist()                       # host ints: the cuts
        at = to_device(numpy.stack([tok, slot]))                       # (2, rows) on the device
        rows = []
        for e in range(E):
            lo, hi = ends[e] - int(per_expert[e]), ends[e]             # expert e's rows
            if hi == lo:
                continue
            t, s = at[0, lo:hi], at[1, lo:hi]                          # the choices e serves
            out = self.expert(xg[t], e)                                # (m, C)
            rows.append(out * w[t, s].reshape(hi - lo, 1))             # weighted by the gate
        if rows:
            y = scatter_add_rows(ops.concat(rows, axis=0) if len(rows) > 1 else rows[0],
                                 at[0], n)                             # (n, C)
        else:
            y = Tensor(xp.zeros(xg.shape, xg.dtype))
        stats = dict(balance=balance_loss(probs, experts, E, k, self.alpha),
                     z=z_loss(logits, self.z_coef),
                     tokens_per_expert=numpy.bincount(experts[keep], minlength=E),
                     routed_per_expert=numpy.bincount(experts.ravel(), minlength=E))
        return y, stats
