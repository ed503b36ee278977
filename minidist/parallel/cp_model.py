"""The model under context parallelism: a GPT (or a TensorParallelGPT) whose sequence is
cut across the cp ranks of a group (the attention core it installs: context_parallel.py).

    grid = ProcessGrid(tp=2, cp=2)                       # 8 ranks: dp = 2
    full = GPT(GPTConfig(..., attention="blockwise"), seed=0)
    tp = TensorParallelGPT(full, grid.tp_comm)           # or full itself, without TP
    model = ContextParallelGPT(tp, grid, "ring")         # tp's attention cores are now CP's
    sync = TensorParallelSync(tp, dp=NaiveDataParallel(model, grid.dp_cp_comm))
    train_step(model, opt, micro_batches(x, y, step, seed, first_sample=...), lr, clip, dp=sync)

Training: each rank of a cp group takes the same whole rows, keeps its positions, embeds
them with their global positions, draws every dropout mask as one process would (the
whole mask, sliced at my positions: PositionsRNG; the attention's by position). The loss
is the sum over my tokens / all tokens, summed over the group in forward (its value: the
mean over all tokens); each rank's weight gradient is then its tokens' share, so the
backward is scaled by cp (SumOverContext) and the gradients are averaged over
grid.dp_cp_comm (dp x cp ranks): exactly the single-process gradient. Megatron-LM
multiplies the loss by the CP size and folds CP into the data-parallel gradient reduction
for the same reason.

What the lesson reads: model.cp_bytes() ({collective: bytes} the attention exchanges sent
since model.reset_counters(); plan/context.py's cp_sent per layer per step is the
formula), model.exposed_s() (seconds spent waiting on the exchange: the ring's waits, all
of a blocking collective's time), minidist.attention.STATS (score tiles and elements).
Not built: pipeline parallelism around it, mixture of experts, grouped-query attention
(the engine has none: plan/context.py's formulas take n_kv_head). A recomputed forward
(recompute "full", "every-k") repeats its exchange, and the counters count it; "selective"
leaves the CP core be (it keeps q, k, v, o and the log-sum-exp, no s x s array).

On a device: the token ids are host data, cut to my positions on the host, so only my
tokens cross (in GPT.forward); my positions are made on the device from the host's
chunk bounds (nothing copied); the loss's sum over the group is minidist.comm's
all-reduce of one number (staged through the host: 8 bytes each way).
"""
from minidist.backend import to_device, to_numpy, xp
from minidist.comm import all_reduce
from minidist.parallel.context_parallel import (ContextParallelAttention, CPError, check_variant,
                                                rank_positions, rank_ranges)
from minidist.rng import DropoutRNG
from minidist.tensor import Function

# ----------------------------------------------------------------------------- the loss


class SumOverContext(Function):
    """Forward: the sum of each cp rank's loss share (a ring all-reduce of one number: the
    mean over every token of the sequence). Backward: the gradient times cp.

    Each rank's backward then carries cp times its tokens' share of the gradient; averaged
    over the dp x cp ranks (DataParallel on grid.dp_cp_comm) the cp shares add up to the
    whole gradient (Megatron-LM scales the loss by the CP size for the same reason)."""

    @staticmethod
    def forward(ctx, x, comm=None):
        ctx.cp = comm.Get_size()
        return all_reduce(comm, x.reshape(1), op="sum").reshape(x.shape)   # x's kind back

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp


class PositionsRNG:
    """A DropoutRNG seen at my positions: mask((B, n_r, ...)) draws the whole (B, T, ...)
    mask one process draws and keeps the columns of my positions (axis 1)."""

    def __init__(self, rng, seq, positions):
        self.rng, self.seq, self.positions = rng, seq, to_device(positions)

    def mask(self, shape, p, dtype):
        whole = self.rng.mask((shape[0], self.seq) + tuple(shape[2:]), p, dtype)
        return xp.ascontiguousarray(whole[:, self.positions])

# ----------------------------------------------------------------------------- the model


class ContextParallelGPT:
    """A GPT or a TensorParallelGPT whose sequence is cut across the cp ranks of a group.

    IT CHANGES THE MODEL IT WRAPS: every block's `attn.core` becomes a
    ContextParallelAttention of this group (the wrapped model is this one's from then on:
    called alone it would still run the CP cores, with the layout of this object's last
    forward). Build the one-process reference from a GPT of its own (the same seed gives
    the same weights), never from the model passed here; wrapping a model twice is refused.

    model: the whole GPT (every rank builds it from the seed) or a TensorParallelGPT made
    from it (sequence parallelism too: each TP rank then keeps a slice of my tokens).
    grid_or_comm: a ProcessGrid (its cp_comm) or the cp communicator itself. Parameters
    keep their names (this object holds none of its own). forward(idx, targets, rng) takes
    the whole (B, T) rows and returns (logits of my positions, the loss over all tokens).
    Weight gradients: NaiveDataParallel or BucketedDataParallel over grid.dp_cp_comm
    (with TP: TensorParallelSync(tp_model, dp=that)).
    """

    def __init__(self, model, grid_or_comm, variant="ring", load_balance=True, overlap=True,
                 block=None):
        comm = getattr(grid_or_comm, "cp_comm", grid_or_comm)
        cfg = model.config
        check_variant(variant)
        if cfg.n_expert > 0:
            raise CPError("context parallelism with mixture of experts is not built: each rank "
                          "would route only its tokens, and the auxiliary losses are per rank")
        if any(isinstance(b.attn.core, ContextParallelAttention) for b in model.transformer.h):
            raise CPError("this model is wrapped already (its attention cores are context-parallel): "
                          "build a new GPT for each ContextParallelGPT")
        self.model, self.config, self.comm = model, cfg, comm
        self.cp, self.cp_rank = comm.Get_size(), comm.Get_rank()
        self.tp_comm = getattr(model, "comm", None)             # a TensorParallelGPT's group
        heads = cfg.n_head // (self.tp_comm.Get_size() if self.tp_comm is not None else 1)
        if variant == "ulysses" and heads % self.cp:
            raise CPError(f"Ulysses gives each of the cp={self.cp} ranks n_head/cp heads: "
                          f"{heads} heads" + (" per tensor-parallel rank" if self.tp_comm else "")
                          + f" do not divide by {self.cp}; choose cp among "
                          + ", ".join(str(c) for c in range(1, heads + 1) if heads % c == 0))
        self.variant, self.load_balance = variant, load_balance
        block = block or getattr(cfg, "attn_block", 64)
        self.cores = [ContextParallelAttention(comm, variant, block, overlap)
                      for _ in model.transformer.h]
        for b, core in zip(model.transformer.h, self.cores):
            b.attn.core = core                                  # the change to the wrapped model
        self.seed, self._calls, self.positions = model.seed, 0, None

    # -- the model's face

    def named_parameters(self):
        return self.model.named_parameters()

    def parameters(self):
        return self.model.parameters()

    def train(self, mode=True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def training(self):
        return self.model.training

    def configure_optimizers(self, weight_decay, lr, betas=(0.9, 0.95), eps=1e-8):
        return self.model.configure_optimizers(weight_decay, lr, betas, eps)

    def __call__(self, *args, **kw):
        return self.forward(*args, **kw)

    # -- what the lesson reads

    def reset_counters(self):
        for c in self.cores:
            c.reset()

    def cp_bytes(self):
        """{collective: bytes} this rank's attention exchanges sent since reset_counters()."""
        out = {}
        for c in self.cores:
            for name, n in c.sent.items():
                out[name] = out.get(name, 0) + n
        return out

    def exposed_s(self):
        """Seconds this rank waited for the attention exchange since reset_counters()."""
        return sum(c.exposed_s for c in self.cores)

    def layout(self, seq):
        """[(lo, hi), ...] per cp rank: the position chunks each holds."""
        return [rank_ranges(seq, self.cp, j, self.load_balance) for j in range(self.cp)]

    # -- forward

    def forward(self, idx, targets=None, rng=None):
        idx = to_numpy(idx)                 # token ids: host data (a no-op for a host array)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size "
                             f"{self.config.block_size}")
        if T < 2 * self.cp:
            raise CPError(f"a sequence of {T} tokens cannot be cut into 2 cp = {2 * self.cp} "
                          f"chunks of at least one token: use cp <= {max(1, T // 2)}")
        ranges = self.layout(T)
        for c in self.cores:
            c.set_layout(ranges)
        mine = ranges[self.cp_rank]
        at = rank_positions(T, self.cp, self.cp_rank, self.load_balance)    # host: cuts the ids
        pos = xp.concatenate([xp.arange(lo, hi) for lo, hi in mine])     # the same, on the device
        self.positions = pos
        if rng is None and self.training and self.config.dropout > 0:
            rng = DropoutRNG(self.seed, self._calls, range(B))   # as GPT.forward does
            self._calls += 1
        rng_mine = PositionsRNG(rng, T, pos) if rng is not None else None
        tgt = None if targets is None else to_numpy(targets)[:, at]
        logits, loss = self.model.forward(idx[:, at], tgt, rng=rng_mine, positions=pos)  # my tokens' mean
        if loss is not None:            # x my share of the tokens, summed over cp: the mean over all
            loss = SumOverContext.apply(loss * (len(pos) / T), comm=self.comm)
        return logits, loss
