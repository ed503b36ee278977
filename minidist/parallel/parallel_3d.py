"""3D parallelism: tensor parallelism inside each pipeline stage, the pipeline across
stages, data parallelism (or ZeRO stage 1) across replicas, all on one ProcessGrid.

    mpirun -n 8 python -m minidist.lessons.07_3d_parallel --tp 2 --pp 2 --dp 2

Nothing here is a new strategy: each piece is the earlier lessons' own object, wrapped
one inside the next (Narayanan et al. 2021, arXiv 2104.04473, Megatron-LM's PTD-P).
    TensorParallelGPT(full, grid.tp_comm)          the whole GPT, each matrix cut t ways
    PipelineGPT(that, pp, grid.pp_rank, v)         keep this stage's blocks (and ends)
    PipelineParallel(stage, grid.pp_comm, ...)     run the schedule; sum the tied wte
    NaiveDataParallel / ZeRO(stage, ..., dp_comm)  average (or reduce-scatter) over replicas

Who talks to whom, per step and rank (b micro-batch rows, s = T, h = n_embd, m
micro-batches, L_r this stage's layers):
    tp group: (4 L_r + [first] + [last]) m all-reduces of b s h, 3 m of b s on the last stage;
              with full or every-k recomputation 2 L_r m more (each layer's forward g's rerun)
    pp group: b s h per micro-batch per boundary each way (point-to-point, same tp_rank),
              one all-reduce of wte's shard between the first and last stage
    dp group: one all-reduce of this rank's gradients (plain), or a reduce-scatter
              plus an all-gather of them (ZeRO-1): 1/(t p) of the model each
The activation that crosses a stage boundary is the TP-replicated (b, s, h) residual
stream: every tp rank of a stage holds it whole, so each sends it to the rank with the
same tp_rank on the next stage, and the pipeline never knows tensor parallelism is there.

Clipping needs the norm of the whole model's gradient, which no rank holds. Each element
is counted once: a TP shard by its rank; a parameter replicated over the tp group (layer
norms, wpe, row-parallel biases) by tp_rank 0 only; the tied wte by the first stage only
(the last stage's copy is the same gradient after the sum); under ZeRO, each rank's
partition of those. The squares are summed over dp (ZeRO only: plain replicas hold equal
copies), then tp, then pp.
"""
import contextlib
import math

import numpy as np

from minidist.comm import all_reduce, stats
from minidist.optim import grad_norm_sq
from minidist.parallel.data_parallel import NaiveDataParallel
from minidist.parallel.pipeline_parallel import PipelineGPT, PipelineParallel
from minidist.parallel.strategy import Strategy
from minidist.parallel.tp_formulas import replicated_elements
from minidist.parallel.tp_model import TensorParallelGPT, shard, shard_shape
from minidist.parallel.zero import flat_groups
from minidist.plan.memory import engine_state_bytes
from minidist.plan.traffic import parallel_3d_sent

GROUPS = ("tp", "pp", "dp", "clip")


def build_stage(full, grid, v=1, recompute="none", k=None):
    """(stage model, tensor-parallel model): the whole GPT cut t ways, then this stage kept;
    its TP blocks recompute their activations as the policy says (recompute.py)."""
    tp_model = TensorParallelGPT(full, grid.tp_comm)
    return PipelineGPT(tp_model, grid.pp, grid.pp_rank, v).set_recompute(recompute, k), tp_model


def counted_once(stage, tp_model, tp_rank):
    """ids of the parameters whose gradient this rank adds to the global norm (see above)."""
    tied = id(stage.transformer.wte.weight) if stage.last and not stage.first else None
    return {id(p) for n, p in stage.named_parameters()
            if id(p) != tied and (n in tp_model.specs or tp_rank == 0)}


class Parallel3D(Strategy):
    """train_step's optimizer and dp slot at once (as ZeRO is): the composed step.

    forward_backward runs the pipeline schedule (TP's collectives happen inside each
    stage's forward and backward); sync sums the tied embedding between the first and
    last stage, then averages over the replicas (or reduce-scatters, ZeRO-1); the norm
    counts every element once; step runs AdamW (or ZeRO's, with its all-gather).
    `traffic` holds what this rank sent in the last step, by group and collective.
    """
    owns_schedule = True

    def __init__(self, stage, tp_model, grid, schedule, m, opt, zero=None):
        if tp_model.sequence_parallel:     # the stages would run plain TP, silently: refuse
            raise ValueError("sequence parallelism inside a pipeline is not built here: PipelineGPT's "
                             "stages run the blocks as plain tensor parallelism")
        self.stage, self.tp_model, self.grid, self.m = stage, tp_model, grid, m
        self.pipe = PipelineParallel(stage, grid.pp_comm, schedule, m, dp=None)
        self.zero = zero                           # a ZeRO(stage, opt, grid.dp_comm, 1), or None
        self.opt = zero if zero is not None else opt
        self.data = NaiveDataParallel(stage, grid.dp_comm) if zero is None and grid.dp > 1 else None
        self.counted = counted_once(stage, tp_model, grid.tp_rank)
        self.param_groups = self.opt.param_groups
        self.traffic = {g: {} for g in GROUPS}

    @contextlib.contextmanager
    def _measured(self, group, elsewhere=None):
        """Add what this rank sends inside the block to `group` (`elsewhere`: {collective:
        group} for those that belong to another); check headers are counted apart."""
        with stats.measure() as m:
            yield
        for name, row in m.items():
            if name not in ("check", "recv") and row["bytes_sent"]:
                t = self.traffic[(elsewhere or {}).get(name, group)]
                t[name] = t.get(name, 0) + row["bytes_sent"]

    # -- the optimizer's face
    def zero_grad(self):
        self.traffic = {g: {} for g in GROUPS}
        self.opt.zero_grad()

    def set_lr(self, lr):
        self.opt.set_lr(lr)

    def store_grads(self):
        """Nothing: AdamW (or ZeRO's) steps on the gradients where sync left them."""

    def step(self):
        with self._measured("dp"):                 # ZeRO-1's all-gather of the updated weights
            self.opt.step()

    def state_bytes(self):
        return self.opt.state_bytes()

    # -- train_step's dp slot
    def forward_backward(self, model, batches, scale):
        # every all-reduce inside a stage's forward and backward is TP's; the pipeline
        # sends activations and gradients point-to-point and broadcasts the loss
        with self._measured("tp", elsewhere={"send": "pp", "broadcast": "pp"}):
            return self.pipe.forward_backward(model, batches, scale)

    def backward_context(self, last):
        raise RuntimeError("3D parallelism runs its own backwards: train_step calls forward_backward")

    def sync(self):
        with self._measured("pp"):                 # wte's two copies: first and last stage
            self.pipe.sync()
        with self._measured("dp"):
            if self.zero is not None:
                self.zero.sync()
            elif self.data is not None:
                self.data.sync()

    def named_grads(self, model=None):
        return self.zero.named_grads() if self.zero is not None else self.stage.named_parameters()

    def named_weights(self, model=None):
        return self.zero.named_weights() if self.zero is not None else self.stage.named_parameters()

    def grad_norm_sq(self, held):
        """The whole model's squared gradient norm, each element once (see the docstring)."""
        if self.zero is not None:
            owner = {id(q): p for g in self.zero.groups for q, p in zip(g.pieces, g.owner)}
            mine = [q for q in held if id(owner[id(q)]) in self.counted]
            sq = self.zero.grad_norm_sq(mine)      # my partitions, summed over dp
        else:
            sq = grad_norm_sq([p for p in held if id(p) in self.counted])
        with self._measured("clip"):
            for comm in (self.grid.tp_comm, self.grid.pp_comm):
                if comm.Get_size() > 1:
                    sq = float(all_reduce(comm, np.array([sq]))[0])
        return sq


def expected_traffic(slot, rows, T, clip=True):
    """{group: {collective: bytes}} this rank sends in one step: plan.traffic.parallel_3d_sent
    of this rank's shapes (tp_sent of its stage's layers and ends, pp_sent for the
    point-to-point bytes, the ring's count for wte's sum, dp_sent or zero_sent over the
    replicas; with clipping (clip), the norm's float64 over tp and pp)."""
    stage, tpm, grid, m = slot.stage, slot.tp_model, slot.grid, slot.m
    cfg = stage.config
    layers = sum(hi - lo for lo, hi in (stage.ranges[s] for s in stage.stages))
    # activation recomputation: each checkpointed layer reruns its forward, 2 more g's (recompute.py)
    again = len(stage.blocks()) if stage.recompute.segment else 0
    wte = stage.transformer.wte.weight.size if stage.first or stage.last else 0   # the tied table's ends
    zero = slot.zero
    groups = None if zero is None else flat_groups(zero)
    return parallel_3d_sent(
        rows // m, T, cfg.n_embd, m, np.dtype(cfg.dtype).itemsize,
        *[(c.Get_size(), c.Get_rank()) for c in (grid.tp_comm, grid.pp_comm, grid.dp_comm)], layers,
        stage.first, stage.last, stage.stages, stage.p * stage.v, wte,
        dp_sizes=[p.size for p in stage.parameters()], zero_groups=groups,
        zero_stage=None if zero is None else zero.stage, recomputed_layers=again,
        sequence_parallel=tpm.sequence_parallel, regather=not tpm.sp_keep_gathered,
        replicated=replicated_elements(tpm), clip=clip)


def stage_param_count(stage, tp_model):
    """Psi_r, the elements of this rank's parameters, from the shapes alone: each of its
    stage's parameters at the single-process shape, cut to its TP shard (the vocabulary
    padded to a multiple of t) or whole where TP replicates it."""
    return sum(math.prod(shard_shape(tp_model.full_shapes[n], tp_model.specs.get(n), tp_model.tp))
               for n, _ in stage.named_parameters())


def expected_memory(slot):
    """{category: bytes} this rank holds after a step, by the ZeRO paper's accounting
    (plan.memory.engine_state_bytes) of Psi_r in the run's dtype: params Psi_r, grads Psi_r (ZeRO-1 keeps
    the whole local gradient and its reduced partition, Psi_r + Psi_r/N_d), AdamW's m and v
    2 Psi_r (ZeRO-1: 2 Psi_r/N_d), N_d = dp. Psi_r/N_d is the paper's even cut; the
    partitions are array_split's, up to one element apart."""
    item = np.dtype(slot.stage.config.dtype).itemsize
    psi = stage_param_count(slot.stage, slot.tp_model)
    return engine_state_bytes(1 if slot.zero is not None else 0, psi, slot.grid.dp, item)


def reference_value(key, ref_state, tp_model):
    """The single-process run's value for one of this rank's keys: "grad:NAME@stepS",
    "weight:NAME" or, under ZeRO, "grad:NAME[a:b]@stepS": the reference's whole tensor cut
    to my TP shard (padding included), then to elements a:b of it."""
    kind, rest = key.split(":", 1)
    tail = ""
    if "@step" in rest:
        rest, step = rest.rsplit("@step", 1)
        tail = "@step" + step
    span = None
    if rest.endswith("]"):
        rest, span = rest[:-1].split("[")
    # the reference's arrays are host copies (compared on the host): cut there, nothing moves
    mine = shard(np.asarray(ref_state[f"{kind}:{rest}{tail}"]), tp_model.specs.get(rest),
                 tp_model.tp_rank, tp_model.tp)
    if span is not None:
        a, b = (int(v) for v in span.split(":"))
        mine = mine.reshape(-1)[a:b]
    return np.asarray(mine)
