"""ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054): data parallelism without the copies.

    mpirun -n 4 python -m minidist.lessons.05_zero --stage 3
    mpirun -n 4 python -m minidist.lessons.05_zero --stage all

Plain data parallelism keeps on every rank the whole optimizer state, the whole gradient
and the whole model. ZeRO cuts each into N partitions, one per rank:
- stage 1: AdamW's m and v for my partition only; I update my partition of the weights
  and all-gather the rest. Gradients: reduce-scatter (I need the sum of my partition only).
- stage 2: also the gradients: each bucket is reduce-scattered as soon as backward
  finished it and the full-size bucket is freed; I keep the sum of my partition.
- stage 3: also the weights: each unit (a transformer block; the rest of the model is
  one more unit) is all-gathered just before its forward and again before its backward,
  and freed after each; the optimizer updates my shard only.

Every flat buffer is cut as numpy.array_split cuts it (`partition`), so a count that does
not divide by N leaves ranks one element apart. Values sent per rank per step, Psi the
parameter count, ring factor (N-1)/N (docs/reference.md#zero-memory-and-communication):
stage 1 and 2: reduce-scatter Psi + all-gather Psi = 2 Psi, as data parallelism's
all-reduce; stage 3: all-gather Psi (forward) + Psi (backward) + reduce-scatter Psi = 3 Psi,
less the root unit's backward gather here (see Stage3Units).

One object is both the optimizer and train_step's `dp` slot: `zero = ZeRO(model, opt, comm,
stage)`, then `train_step(model, zero, batches, lr, clip, dp=zero)`. Its AdamW is
optim.AdamW itself, run on "pieces": Parameters that are views of my partition, one per
model parameter it overlaps, each with the weight decay the single-process optimizer
gives that parameter, so every formula of the update lives once.
"""
import contextlib

import numpy as np
from mpi4py import MPI

from minidist.comm import ring_all_gather, ring_reduce_scatter
from minidist.comm.nonblocking import ring_reduce_scatter_start
from minidist.nn import Parameter
from minidist.optim import AdamW, grad_norm_sq
from minidist.parallel.data_parallel import assign_buckets
from minidist.tensor import backward_step_callback


def partition(n, size, rank):
    """(lo, hi): rank's share of n elements, as numpy.array_split(range(n), size) cuts.

    The first n % size ranks get one element more. (Exercise 5.1.)
    """
    q, r = divmod(n, size)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


def reduce_scatter_grad(comm, flat):
    """My partition of the average over ranks of `flat`: a ring reduce-scatter (sum), / N.

    Returns a new array; `flat` is left as it is. Data parallelism's all-reduce would send
    twice as much and leave every rank the whole average it no longer needs. (Exercise 5.2.)
    """
    return ring_reduce_scatter(comm, flat, op="sum") / comm.Get_size()


class Group:
    """Parameters laid end to end in one flat buffer, partitioned across the ranks.

    `pieces` are Parameters over my partition, one per model parameter it overlaps:
    views of that parameter's own array (`shard=None`: stages 1, 2) or of the shard
    this group keeps (stage 3, where the model's arrays are gathered only when used).
    """

    def __init__(self, named, comm, shard=False):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]   # kept: a freed parameter's array is empty
        self.offsets = np.cumsum([0] + [p.size for p in self.params]).tolist()
        self.n, self.dtype = self.offsets[-1], self.params[0].dtype
        self.shard_itemsize = self.params[0].data.itemsize
        self.lo, self.hi = partition(self.n, comm.Get_size(), comm.Get_rank())
        self.shard = self.flat_data()[self.lo:self.hi].copy() if shard else None
        self.grad = None                            # my partition's gradient, summed over ranks / N
        self.pieces, self.owner, self.names_of_pieces = [], [], []
        for name, p, off in zip(self.names, self.params, self.offsets):
            a, b = max(self.lo, off) - off, min(self.hi, off + p.size) - off    # noqa (p is whole here)   # p's elements in my partition
            if a >= b:
                continue
            src = self.shard[off + a - self.lo:off + b - self.lo] if shard else p.data.reshape(-1)[a:b]
            self.pieces.append(Parameter(src))
            self.owner.append(p)
            self.names_of_pieces.append(f"{name}[{a}:{b}]")

    def flat_data(self):
        return np.concatenate([p.data.reshape(-1) for p in self.params]) if self.params else np.zeros(0)

    def flat_grads(self, drop=True):
        """The model's gradients of this group end to end (zeros where none); with `drop`
        the full-size gradients go as they are copied (stages 2, 3)."""
        flat = np.zeros(self.n, self.dtype)
        for p, off in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[off:off + p.grad.size] = p.grad.reshape(-1)
                if drop:
                    p.grad = None
        return flat

    def add_grad(self, part):
        """Accumulate my reduced partition (gradient accumulation adds micro-batches)."""
        self.grad = part if self.grad is None else self.grad + part
        for q, (p, off) in zip(self.pieces, self._piece_spans()):
            q.grad = self.grad[off:off + q.size].reshape(q.shape)

    def _piece_spans(self):
        for q, p in zip(self.pieces, self.owner):
            i = self.params.index(p)
            yield p, max(self.lo, self.offsets[i]) - self.lo

    def write_back(self, full):
        """Copy a gathered flat buffer into the model's parameters (stages 1 and 2)."""
        self.point(full, copy=True)

    def point(self, full, copy=False):
        """Make the parameters views of (or, with copy, copies from) a gathered flat buffer."""
        for p, shape, off in zip(self.params, self.shapes, self.offsets):
            view = full[off:off + int(np.prod(shape, dtype=np.int64))].reshape(shape)
            if copy:
                p.data[...] = view
            else:
                p.data = view


def sharded_adamw(opt, groups):
    """optim.AdamW over my pieces, with the hyperparameters of the group each piece's
    parameter has in `opt` (the single-process AdamW): weight decay exactly where it decays."""
    where = {id(p): g for g in opt.param_groups for p in g["params"]}
    by_group = {}
    for grp in groups:
        for q, p in zip(grp.pieces, grp.owner):
            by_group.setdefault(id(where[id(p)]), (where[id(p)], []))[1].append(q)
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": qs}
                    for g, qs in by_group.values()]
    d = opt.param_groups[0]
    return AdamW(param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"])


class ZeRO:
    """Stages 1 and 2 (stage 3: Stage3Units below, through this same class).

    stage 1: gradients accumulate whole on each rank, one reduce-scatter in sync().
    stage 2: buckets of `bucket_bytes` in reverse parameter order; `overlap=False` (naive):
      after each micro-batch's backward, bucket after bucket, reduce-scatter then free;
      `overlap=True`: a bucket's non-blocking reduce-scatter starts when its last
      gradient is ready and moves on between backward's ops (DeepSpeed's overlap_comm);
      at most `max_in_flight` at once (DeepSpeed's double buffer): starting one more waits
      for the oldest, so the full-size copies alive stay a few buckets, not the gradient.
    """

    def __init__(self, model, opt, comm, stage=1, bucket_bytes=2**18, overlap=False,
                 reshard_after_forward=True, prefetch=False, max_in_flight=2):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
        self.model, self.comm, self.stage, self.overlap = model, comm, stage, overlap
        self.max_in_flight = max_in_flight
        named = model.named_parameters()
        if stage == 1:
            self.groups = [Group(named, comm)]
        elif stage == 2:
            buckets = assign_buckets([p.data.nbytes for _, p in named], bucket_bytes)
            self.groups = [Group([named[i] for i in sorted(b)], comm) for b in buckets]
        else:
            from minidist.parallel.fsdp import Units
            self.units = Units(model, comm, reshard_after_forward, prefetch)
            self.groups = self.units.groups
            self.units.on_grad = self._note_grads   # a unit's full gradients, just before its reduce
        self.inner = sharded_adamw(opt, self.groups)
        self.param_groups = self.inner.param_groups
        self.hooks = []
        if stage == 2:
            self.of = {id(p): g for g in self.groups for p in g.params}
            self.hooks = [p.register_grad_ready_hook(self._grad_ready) for _, p in named]
        self.pending, self.in_flight, self.communicating = {}, [], False
        self.peak_grad_bytes = self.held_grad_bytes = 0
        self.peak_grad_split = {"full": 0, "partitions": 0, "in_flight": 0}   # what made the peak

    # -- the optimizer's face
    def zero_grad(self):
        self.model.zero_grad()
        for g in self.groups:
            g.grad = None
            for q in g.pieces:
                q.grad = None

    def set_lr(self, lr):
        self.inner.set_lr(lr)

    def state_bytes(self):
        return self.inner.state_bytes()

    def step(self):
        """AdamW on my pieces, then (stages 1, 2) all-gather the updated weights."""
        self.held_grad_bytes = self.grad_bytes()   # what the update reads (or keeps) now
        self.inner.step()
        if self.stage < 3:
            for g in self.groups:
                mine = g.flat_data()[g.lo:g.hi]
                g.write_back(ring_all_gather(self.comm, mine))

    # -- train_step's dp slot
    @contextlib.contextmanager
    def backward_context(self, last):
        if self.stage == 1:
            yield                                   # whole gradients accumulate locally
            return
        if self.stage == 3:
            with self.units.backward_context():
                yield
            return
        self.pending = {id(g): len(g.params) for g in self.groups}
        self.communicating, self.in_flight = self.overlap, []
        with backward_step_callback(self._progress) if self.overlap else contextlib.nullcontext():
            yield
        self.communicating = False
        self._note_grads()                          # naive: every full-size gradient is alive now
        for g in self.groups:                       # naive: now, bucket after bucket
            if not self.overlap or self.pending[id(g)] > 0:
                self._reduce(g)
        while self.in_flight:
            self._collect(0)
        self._note_grads()

    def _grad_ready(self, p):
        if not self.communicating:
            return
        g = self.of[id(p)]
        self.pending[id(g)] -= 1
        self._note_grads()
        if self.pending[id(g)] == 0:                # the bucket is complete: start its reduce-scatter
            while len(self.in_flight) >= self.max_in_flight:
                self._collect(0)                    # both buffers busy: wait for the oldest
            self.in_flight.append((g, ring_reduce_scatter_start(self.comm, g.flat_grads())))

    def _progress(self):
        for _, h in self.in_flight:
            h.test()
        for i in [i for i, (_, h) in enumerate(self.in_flight) if h.done][::-1]:
            self._collect(i)                        # done: keep my partition, drop the full copy

    def _collect(self, i):
        g, h = self.in_flight.pop(i)
        g.add_grad(h.wait() / self.comm.Get_size())

    def _reduce(self, g):
        from minidist.parallel.fsdp import reduce_grads     # FSDP's units reduce the same way
        reduce_grads(self.comm, g)
        self._note_grads()

    def sync(self):
        if self.stage == 1:
            self._note_grads()
            g = self.groups[0]
            # stage 1 keeps the whole local gradient until the step (DeepSpeed's stage 1 too)
            g.add_grad(reduce_scatter_grad(self.comm, g.flat_grads(drop=False)))
            self._note_grads()

    def named_grads(self):
        """My partition's gradients, as (name[a:b], piece) pairs: what the run is compared on."""
        return [(name, q) for g in self.groups for name, q in zip(g.names_of_pieces, g.pieces)]

    def grad_norm_sq(self, held):
        """The whole gradient's squared norm: my pieces' squares, summed over ranks (MPI's
        own Allreduce of one float64: bookkeeping, not counted with the stage's traffic)."""
        mine = np.array([grad_norm_sq(held)])
        out = np.empty(1)
        self.comm.Allreduce(mine, out, op=MPI.SUM)
        return float(out[0])

    # -- memory, measured from the arrays this rank holds
    def _note_grads(self):
        split = self.grad_split()
        if sum(split.values()) > self.peak_grad_bytes:
            self.peak_grad_bytes, self.peak_grad_split = sum(split.values()), split

    def grad_split(self):
        """Gradient bytes alive now, read from the arrays: the model's full-size .grad
        arrays, my reduced partitions, and the buckets whose reduce-scatter is in flight."""
        return {"full": sum(p.grad.nbytes for p in self.model.parameters() if p.grad is not None),
                "partitions": sum(g.grad.nbytes for g in self.groups if g.grad is not None),
                "in_flight": sum(h.src.nbytes for _, h in self.in_flight if not h.done)}

    def grad_bytes(self):
        return sum(self.grad_split().values())

    def memory(self):
        """Bytes by category on this rank, measured from its arrays after the step:
        weights (stage 3: my shards), gradients as the optimizer found them (stage 1 keeps
        the whole local gradient beside my partition), optimizer state."""
        params = sum(p.data.nbytes for p in self.model.parameters())
        if self.stage == 3:
            params += sum(g.shard.nbytes for g in self.groups)
        return {"params": params, "grads": self.held_grad_bytes, "optimizer": self.state_bytes()}

    def named_weights(self):
        """Stage 3: my shards, as (name[a:b], piece); stages 1 and 2: the whole model."""
        if self.stage < 3:
            return self.model.named_parameters()
        return [(name, q) for g in self.groups for name, q in zip(g.names_of_pieces, g.pieces)]


def reference_slice(key, ref_state):
    """The reference's value for a sharded key: "grad:NAME[a:b]@stepS" -> elements a:b of
    the flattened "grad:NAME@stepS" (keys without [a:b] are returned as they are)."""
    if "[" not in key:
        return ref_state[key]
    head, rest = key.split("[", 1)
    span, tail = rest.split("]", 1)
    a, b = (int(v) for v in span.split(":"))
    return np.asarray(ref_state[head + tail]).reshape(-1)[a:b]


# ----------------------------------------------------------------------------- formulas


def expected_sent(zero, micro_batches=1):
    """Bytes this rank sends per step, {collective: bytes}, counted chunk by chunk from the
    ring (uneven array_split chunks included): what the measurement must equal exactly.

    Stage 1: one reduce-scatter and one all-gather of every group per step. Stage 2: a
    reduce-scatter per micro-batch (the full gradient is never kept), one all-gather.
    Stage 3: per micro-batch, every unit gathered for forward, the blocks again for
    backward (when resharded), every unit reduce-scattered; no all-gather after the step.
    """
    from minidist.parallel.tp_formulas import ring_all_gather_sent, ring_reduce_scatter_sent
    size, rank = zero.comm.Get_size(), zero.comm.Get_rank()
    rs = lambda g: ring_reduce_scatter_sent(g.n, 1, size, rank) * g.shard_itemsize   # noqa: E731
    ag = lambda g: ring_all_gather_sent(g.n, 1, size, rank) * g.shard_itemsize       # noqa: E731
    k = 1 if zero.stage == 1 else micro_batches
    out = {"reduce_scatter": k * sum(rs(g) for g in zero.groups)}
    if zero.stage < 3:
        out["all_gather"] = sum(ag(g) for g in zero.groups)
    else:
        again = zero.groups[1:] if zero.units.reshard else []
        out["all_gather"] = k * (sum(ag(g) for g in zero.groups) + sum(ag(g) for g in again))
    return out


def paper_sent(stage, psi, size, itemsize, micro_batches=1, root=0, reshard=True):
    """The paper's count, bytes per rank per step: (N-1)/N x (2 Psi for stages 0-2, 3 Psi
    for stage 3, less the root unit's backward gather `root` this code never makes; 2 Psi
    without resharding after forward: nothing is gathered twice)."""
    f = (size - 1) / size * itemsize
    if stage == 0:
        return f * 2 * psi
    if stage == 3:
        return f * micro_batches * ((3 * psi - root) if reshard else 2 * psi)
    return f * ((psi if stage == 1 else micro_batches * psi) + psi)


def paper_memory(stage, psi, size, itemsize, k_bytes=None):
    """Bytes per rank by category, the paper's accounting for this run's dtype: weights and
    gradients of `itemsize` bytes, AdamW's m and v (2 itemsize per parameter, k_bytes to
    override: 12 for mixed precision's fp32 master, m and v). Stage 1's grads, Psi + Psi/N
    (the whole local gradient and its reduced partition), are this implementation's choice
    (DeepSpeed's stage 1 also keeps the local gradient): the paper counts Psi for stage 1.
    The reduced partition is all stages 2 and 3 keep."""
    k_bytes = 2 * itemsize if k_bytes is None else k_bytes
    part = psi / size
    return {"params": itemsize * (part if stage == 3 else psi),
            "grads": itemsize * (psi if stage == 0 else psi + part if stage == 1 else part),
            "optimizer": k_bytes * (psi if stage == 0 else part)}
