"""A GPT with nanoGPT's shape and names, on the minidist engine.

    python -c "from minidist.model import GPT, GPTConfig; m = GPT(GPTConfig()); print(m.get_num_params())"

Classes in dependency order: CausalSelfAttention, MLP, Block, GPTConfig, GPT. Every
Linear computes x @ W + b with W of shape (in, out), the transpose of PyTorch's weight.
The output head is tied to the token embedding: logits = x @ wte.T.

The attention core is pluggable: GPTConfig(attention="plain") runs fused.CausalAttention,
which keeps the (T, T) probabilities for backward; attention="blockwise" installs
`attention.BlockwiseCore(attn_block)` as each layer's `attn.core`, the memory-efficient
attention that keeps none (minidist/attention.py). A core is any callable
core(q, k, v, dropout_p, rng, head0) -> y (B, nh, T, hs); context parallelism swaps in
its own. Selective recomputation checkpoints only the plain core: a blockwise core has
nothing of size T^2 to drop.

Generation keeps a key/value cache (`KVCache`, `generate_greedy`): a causal model's keys
and values of past positions never change, so each new token feeds only itself through
the model and attends to the cached ones, one position's compute per token instead of
the whole prefix's. minidist/parallel/tp_model.py reuses the cache, one per rank for its
own heads.
"""
import math
from dataclasses import dataclass

import numpy

from minidist import ops, recompute
from minidist.attention import BlockwiseCore
from minidist.backend import dtype_of, to_device, to_numpy, xp
from minidist.moe import MoEMLP
from minidist.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleDict, ModuleList
from minidist.optim import AdamW
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor, is_grad_enabled, no_grad

# ----------------------------------------------------------------------------- the KV cache


def cached_attention(q, k, v, first):
    """Causal attention of queries at positions first, first+1, ... over keys 0..Tk-1.

    q (B, nh, Tq, hs), k and v (B, nh, Tk, hs) arrays with Tk = first + Tq: query i may
    see keys up to position first + i. The same steps as fused.CausalAttention's forward
    (which is the case first = 0), without saving anything: generation has no backward.
    """
    Tq, Tk, hs = q.shape[-2], k.shape[-2], q.shape[-1]
    att = (q * (1.0 / math.sqrt(hs))) @ k.swapaxes(-1, -2)            # (B, nh, Tq, Tk)
    att += xp.triu(xp.full((Tq, Tk), -xp.inf, dtype=att.dtype), k=first + 1)
    att -= att.max(axis=-1, keepdims=True)
    xp.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    return att @ v                                                    # (B, nh, Tq, hs)


class LayerKV:
    """One layer's keys and values so far: (B, nh, capacity, hs) buffers, `length` filled.

    Allocated once for the whole block (as inference engines do), on the first call,
    when the batch and the number of heads (all of them, or one rank's) are known.
    """

    def __init__(self, capacity):
        self.capacity, self.length, self.k, self.v = capacity, 0, None, None

    def attend(self, q, k, v):
        """Append the new positions' k, v (B, nh, Tn, hs); attend q to every cached position."""
        lo, hi = self.length, self.length + k.shape[2]
        if hi > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {hi} asked")
        if self.k is None:
            shape = k.shape[:2] + (self.capacity,) + k.shape[3:]
            self.k, self.v = xp.empty(shape, k.dtype), xp.empty(shape, v.dtype)
        self.k[:, :, lo:hi], self.v[:, :, lo:hi] = k, v
        self.length = hi
        return cached_attention(q, self.k[:, :, :hi], self.v[:, :, :hi], lo)


class KVCache:
    """Keys and values of every position seen so far, one LayerKV per layer.

    Memory: 2 x n_layer x B x block_size x n_embd numbers (per rank under tensor
    parallelism: its heads only, 1/t of that).
    """

    def __init__(self, n_layer, capacity):
        self.layers = [LayerKV(capacity) for _ in range(n_layer)]

    @property
    def length(self):
        return self.layers[0].length

    def nbytes(self):
        return sum(a.nbytes for lk in self.layers for a in (lk.k, lk.v) if a is not None)


def generate_greedy(model, idx, max_new_tokens, use_cache=True):
    """Greedy decoding: append the most likely token max_new_tokens times.

    Returns (idx (B, T + max_new_tokens), [the last position's logits of each step]).
    model: a GPT or a tensor-parallel GPT (anything with forward(idx, cache=), new_cache()
    and greedy_token(logits)). With the cache, the first step feeds the prompt and every
    later step only the token just chosen. Past block_size tokens nanoGPT crops the
    context to the last block_size, which shifts every position: nothing cached is valid
    any more, so from there each step runs the cropped window whole, as without a cache.
    """
    idx = to_numpy(idx)                                                 # the tokens live on the host
    bs, steps = model.config.block_size, []
    was_training = model.training
    model.eval()
    with no_grad():
        cache = model.new_cache() if use_cache else None
        for _ in range(max_new_tokens):
            if cache is not None and idx.shape[1] > bs:
                cache = None                                            # past the block: recompute
            x = idx[:, cache.length:] if cache is not None else idx[:, -bs:]
            logits, _ = model(x, cache=cache)
            last = logits.data[:, -1, :]                                # (B, vocab) or my columns
            steps.append(last)
            nxt = numpy.asarray(to_numpy(model.greedy_token(last)), dtype=idx.dtype)
            idx = numpy.concatenate([idx, nxt[:, None]], axis=1)
    model.train(was_training)
    return idx, steps

# ----------------------------------------------------------------------------- the GPT


class CausalSelfAttention(Module):
    def __init__(self, config):
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias, dtype=config.dtype)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias, dtype=config.dtype)
        self.resid_dropout = Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.recompute_core = False                                    # selective recomputation
        # the attention core: None runs the plain one (fused.CausalAttention, through
        # recompute.attention_core); else core(q, k, v, dropout_p, rng, head0) -> y
        self.core = BlockwiseCore(config.attn_block) if config.attention == "blockwise" else None

    def forward(self, x, rng=None, cache=None):
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = ops.split(self.c_attn(x), self.n_embd, axis=2)     # 3 x (B, T, C)
        q = q.reshape(B, T, nh, hs).transpose(1, 2)                    # (B, nh, T, hs)
        k = k.reshape(B, T, nh, hs).transpose(1, 2)                    # (B, nh, T, hs)
        v = v.reshape(B, T, nh, hs).transpose(1, 2)                    # (B, nh, T, hs)
        if cache is not None:                                          # generation: attend to the past too
            y = Tensor(cache.attend(q.data, k.data, v.data))           # (B, nh, T, hs)
        elif self.core is not None:   # saves q, k, v, o, lse: selective recomputation leaves it be
            y = self.core(q, k, v, self.dropout if self.training else 0.0, rng, 0)   # (B, nh, T, hs)
        else:
            p = self.dropout if self.training else 0.0
            y = recompute.attention_core(q, k, v, p, rng, self.recompute_core)   # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)                         # (B, T, C)
        return self.resid_dropout(self.c_proj(y), rng)


class MLP(Module):
    def __init__(self, config):
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias, dtype=config.dtype)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias, dtype=config.dtype)
        self.dropout = Dropout(config.dropout)
        self.gelu = config.gelu                                        # "tanh" or "erf"

    def forward(self, x, rng=None):
        return self.dropout(self.c_proj(ops.gelu(self.c_fc(x), self.gelu)), rng)   # (B, T, 4C) inside


class Block(Module):
    def __init__(self, config, moe=False):
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, dtype=config.dtype)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, dtype=config.dtype)
        self.mlp = MoEMLP(config) if moe else MLP(config)              # minidist/moe.py

    def forward(self, x, rng=None, cache=None):
        x = x + self.attn(self.ln_1(x), rng, cache)
        x = x + self.mlp(self.ln_2(x), rng)
        return x


ATTENTIONS = ("plain", "blockwise")


@dataclass
class GPTConfig:
    block_size: int = 128
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    dtype: str = "float32"
    # the MLP's GELU: "tanh", GPT-2's approximation (its gelu in openai/gpt-2 src/model.py),
    # or "erf", the exact x Phi(x) of PyTorch's nn.GELU(), which nanoGPT's MLP uses (set it
    # to run a model trained there); this project keeps tanh as its default. Dense MLPs
    # only: tensor-parallel and MoE layers run tanh
    gelu: str = "tanh"
    # attention core: "plain" (fused.CausalAttention, keeps the (T, T) probabilities) or
    # "blockwise" (minidist/attention.py: tiles of attn_block queries x keys, keeps none)
    attention: str = "plain"
    attn_block: int = 64
    # mixture of experts (minidist/moe.py); n_expert = 0 is the dense model, unchanged
    n_expert: int = 0                    # experts per MoE layer
    top_k: int = 2                       # experts per token: 1 (Switch) or 2 (GShard)
    capacity_factor: float | None = 1.25 # None: dropless (no token is ever dropped)
    moe_every: int = 2                   # block i is MoE when (i + 1) % moe_every == 0
    moe_groups: int = 1                  # routing groups the batch is split into
    moe_alpha: float = 0.01              # load-balancing loss coefficient (Switch)
    moe_z: float = 0.0                   # router z-loss coefficient (ST-MoE)

    def is_moe(self, i):
        """Whether block i's MLP is a mixture of experts: when n_expert > 0, every
        moe_every-th block, counting from 1 (blocks 1, 3, 5, ... at moe_every = 2: every
        other layer, as Switch and GShard place them)."""
        return self.n_expert > 0 and (i + 1) % self.moe_every == 0

    def validate(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}): "
                             f"each head gets n_embd / n_head channels")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout}")
        dtype_of(self.dtype)          # raises ValueError for an unknown dtype
        if self.gelu not in ops.GELU_FORMS:
            raise ValueError(f"gelu must be one of {', '.join(ops.GELU_FORMS)}, not {self.gelu!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, not {self.attention!r}")
        try:
            whole = not isinstance(self.attn_block, bool) and int(self.attn_block) == self.attn_block
        except (TypeError, ValueError):
            whole = False
        if not whole or self.attn_block < 1:
            raise ValueError(f"attn_block (the tile of blockwise attention) must be a whole number "
                             f"of positions, at least 1, not {self.attn_block!r}")
        if self.gelu != "tanh" and int(self.n_expert) > 0:
            raise ValueError(f"gelu={self.gelu!r} is for dense MLPs; MoE experts run tanh GELU")
        if int(self.n_expert) < 0:
            raise ValueError(f"n_expert must be 0 (dense) or more, not {self.n_expert}")
        if self.top_k not in (1, 2) or (self.n_expert > 0 and self.top_k > self.n_expert):
            raise ValueError(f"top_k must be 1 or 2, and at most n_expert ({self.n_expert}), not {self.top_k}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive (or None: dropless), not {self.capacity_factor}")
        for name in ("moe_every", "moe_groups"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.moe_alpha < 0 or self.moe_z < 0:
            raise ValueError(f"moe_alpha and moe_z must be at least 0, not {self.moe_alpha} and {self.moe_z}")
        return self


class GPT(Module):
    def __init__(self, config, seed=0):
        config.validate()
        self.config, self.seed, self._calls = config, seed, 0
        self.transformer = ModuleDict(
            wte=Embedding(config.vocab_size, config.n_embd, dtype=config.dtype),
            wpe=Embedding(config.block_size, config.n_embd, dtype=config.dtype),
            drop=Dropout(config.dropout),
            h=ModuleList([Block(config, config.is_moe(i)) for i in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias, dtype=config.dtype),
        )
        self._init_weights(seed)
        self.recompute = recompute.Policy("none")

    def set_recompute(self, policy="none", k=None):
        """Recompute activations in backward instead of keeping them (minidist/recompute.py):
        "none", "full" (every block), "every-k" (segments of k blocks, k = round(sqrt(L)) by
        default) or "selective" (the attention core). Gradients are unchanged, exactly."""
        if self.config.n_expert > 0 and policy in ("full", "every-k"):
            raise ValueError(f"recompute {policy!r} with mixture of experts: the checkpoint's forward runs "
                             f"without a graph, so the MoE auxiliary losses inside it would get no gradient "
                             f"(use 'none' or 'selective')")
        recompute.set_policy(self, policy, k)
        return self

    def _init_weights(self, seed):
        """nanoGPT's init: N(0, 0.02) weights, c_proj N(0, 0.02/sqrt(2 n_layer)), zero biases,
        layer norms at one; drawn in named_parameters order, so a seed fixes every bit."""
        g = numpy.random.default_rng(seed)
        dt = dtype_of(self.config.dtype)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.data = xp.zeros(p.shape, dt)
            elif p.ndim == 1:                                          # layer norm weight
                p.data = xp.ones(p.shape, dt)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
                p.data = to_device(g.normal(0.0, std, size=p.shape).astype(dt))   # drawn on the host

    def get_num_params(self, non_embedding=True):
        """Parameter count; non_embedding leaves out the position table, as nanoGPT does
        (the token table counts: it is the output head too)."""
        n = sum(p.size for p in self.parameters())
        return n - self.transformer.wpe.weight.size if non_embedding else n

    def forward(self, idx, targets=None, rng=None, cache=None, positions=None):
        """idx (B, T) ints -> logits (B, T, vocab) and the mean cross-entropy (or None).

        cache: a KVCache (generation, under no_grad): idx holds the positions after the
        cached ones, which it attends to as well. positions: the global position of each
        column of idx (context parallelism: a rank's chunks; cp_model.py); default 0..T-1.
        """
        idx = to_device(idx)                # the token ids cross to the device here (a no-op on cpu)
        B, T = idx.shape
        first = check_positions(self, T, cache)
        if rng is None and self.training and self.config.dropout > 0:
            rng = DropoutRNG(self.seed, self._calls, range(B))         # deterministic repeats
            self._calls += 1
        tr = self.transformer
        tok_emb = tr.wte(idx)                                           # (B, T, C)
        where = xp.arange(first, first + T) if positions is None else to_device(positions)
        pos_emb = tr.wpe(where)                                         # (T, C)
        x = tr.drop(tok_emb + pos_emb, rng)
        x = recompute.run_blocks(self.recompute, tr.h, x, rng, caches=None if cache is None else cache.layers)
        x = tr.ln_f(x)
        logits = x @ tr.wte.weight.T                                    # (B, T, vocab)
        loss = ops.cross_entropy(logits, to_device(targets)) if targets is not None else None
        if loss is not None and self.moe_layers():
            loss = loss + self.moe_aux_loss()                          # balance + z, every MoE layer
        return logits, loss

    def moe_layers(self):
        """[(block index, MoEMLP)] of the MoE blocks (empty for a dense model)."""
        return [(i, b.mlp) for i, b in enumerate(self.transformer.h) if isinstance(b.mlp, MoEMLP)]

    def moe_aux_loss(self):
        """The last forward's auxiliary losses, summed over MoE layers (a Tensor)."""
        total = 0.0
        for _, m in self.moe_layers():
            total = m.aux["balance"] + m.aux["z"] + total
        return total

    def moe_stats(self):
        """What the last forward's routers did, per MoE layer: {block index: dict(
        tokens_per_expert (E,) after capacity, routed_per_expert (E,) before it, dropped,
        balance, z (floats))}. Empty before the first forward and for a dense model."""
        return {i: dict(tokens_per_expert=m.aux["tokens_per_expert"], routed_per_expert=m.aux["routed_per_expert"],
                        dropped=m.aux["dropped"], balance=m.aux["balance"].item(), z=m.aux["z"].item())
                for i, m in self.moe_layers() if m.aux is not None}

    def configure_optimizers(self, weight_decay, lr, betas=(0.9, 0.95), eps=1e-8):
        """AdamW with weight decay on 2-D parameters (matmul weights, embeddings) only."""
        params = self.parameters()
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return AdamW(groups, lr=lr, betas=betas, eps=eps)

    def new_cache(self):
        return KVCache(self.config.n_layer, self.config.block_size)

    def greedy_token(self, logits):
        """The id of each row's largest logit (the first, on a tie): (B, vocab) -> (B,)."""
        return xp.argmax(logits, axis=-1)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, rng=None):
        """Append max_new_tokens sampled tokens to idx (B, T); rng a numpy Generator."""
        rng = rng if rng is not None else numpy.random.default_rng(self.seed)
        idx = to_numpy(idx)                               # the tokens live on the host, sampled there
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                cond = idx[:, -self.config.block_size:]
                logits, _ = self(cond)
                last = to_numpy(logits.data[:, -1, :])               # the last position's, home
                logits = numpy.asarray(last, dtype=numpy.float64) / temperature
                if top_k is not None:
                    kth = numpy.sort(logits, axis=-1)[:, -min(top_k, logits.shape[-1])][:, None]
                    logits = numpy.where(logits < kth, -numpy.inf, logits)
                probs = numpy.exp(logits - logits.max(axis=-1, keepdims=True))
                probs /= probs.sum(axis=-1, keepdims=True)
                nxt = numpy.array([[rng.choice(len(p), p=p)] for p in probs])
                idx = numpy.concatenate([idx, nxt], axis=1)
        self.train(was_training)
        return idx


def check_positions(model, T, cache):
    """The position of idx's first token (after the cached ones); refuses what cannot run."""
    first = 0 if cache is None else cache.length
    if first + T > model.config.block_size:
        raise ValueError(f"sequence of length {first + T} is longer than block_size {model.config.block_size}")
    if cache is not None and is_grad_enabled():
        raise RuntimeError("a KV cache is for generation: run the model under no_grad()")
    return first
