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
less the root unit's backward gather here (see fsdp.Units).

One object is both the optimizer and train_step's `dp` slot: `zero = ZeRO(model, opt, comm,
stage)`, then `train_step(model, zero, batches, lr, clip, dp=zero)`. Stage 3 takes its units
from the caller, `ZeRO(model, opt, comm, 3, units=fsdp.Units(model, comm))`, which is what
`fsdp.FSDP` builds. Its AdamW is
optim.AdamW itself, run on "pieces": Parameters that are views of my partition, one per
model parameter it overlaps, each with the weight decay the single-process optimizer
gives that parameter, so every formula of the update lives once.

Layout: the flat sharded buffer (Group), its partition, gather and reduce-scatter live in
parallel/flat_shards.py, below this file and fsdp.py. Stage 3 is FSDP's units under this
optimizer, so fsdp.py imports this file (FSDP = ZeRO at stage 3 over its Units) and this
file never imports fsdp.py: it takes the units as an argument (any object with `groups`,
`reshard`, `on_grad` and `backward_context`). This file stays the optimizer and the dp
slot; gathering and freeing units stays fsdp's topic.

Offload (ZeRO-Infinity's NVMe tier, parallel/offload.py): `ZeRO(..., offload="disk",
offload_dir=PATH, chunk_bytes=...)` keeps AdamW's m and v of my partition (and, at stage
3, my shards) in numpy.memmap files, stepped chunk by chunk with the same bits; `close()`
or a `with` block removes the files; `offload_bytes()` counts what the steps moved.

On a device the partitions and buffers are device arrays (flat_shards.py); the one host
number per step is the gradient norm's square (optim.grad_norm_sq brings one float home),
summed over ranks with MPI's own Allreduce.
"""
import contextlib

import numpy as np
from mpi4py import MPI

from minidist.comm import ring_all_gather
from minidist.comm.nonblocking import ring_reduce_scatter_start
from minidist.optim import AdamW, grad_norm_sq
from minidist.parallel.pieces import Held
from minidist.parallel.strategy import Strategy
from minidist.parallel import offload as offload_module
from minidist.parallel.data_parallel import assign_buckets
# the flat sharded buffer and the exercises' answers 5.1 and 5.2, re-exported under these
# names (zero.partition, zero.reduce_scatter_grad, zero.Group: the very same objects)
from minidist.parallel.flat_shards import Group, partition, reduce_grads, reduce_scatter_grad  # noqa: F401
from minidist.plan.traffic import zero_sent
from minidist.tensor import backward_step_callback


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


class ZeRO(Strategy):
    """Stages 1 and 2, and stage 3 over the units it is given (fsdp.Units).

    stage 1: gradients accumulate whole on each rank, one reduce-scatter in sync().
    stage 2: buckets of `bucket_bytes` in reverse parameter order; `overlap=False` (naive):
      after each micro-batch's backward, bucket after bucket, reduce-scatter then free;
      `overlap=True`: a bucket's non-blocking reduce-scatter starts when its last
      gradient is ready and moves on between backward's ops (DeepSpeed's overlap_comm);
      at most `max_in_flight` at once (DeepSpeed's double buffer): starting one more waits
      for the oldest, so the full-size copies alive stay a few buckets, not the gradient.

    offload: None, or "disk" (parallel/offload.py: AdamW's state, and stage 3's shards, in
      files in `offload_dir` (None: a temporary folder), `chunk_bytes` at a time), or "host"
      (refused: on NumPy host and device are one memory). Close it (`close()`, `with`).
    """

    def __init__(self, model, opt, comm, stage=1, bucket_bytes=2**18, overlap=False,
                 units=None, max_in_flight=2, reduce_dtype=None, offload=None, offload_dir=None,
                 chunk_bytes=4 * 2**20):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
        if stage == 3 and units is None:
            raise ValueError("ZeRO stage 3 gathers and frees units: pass units=fsdp.Units(model, comm) "
                             "(or build it with fsdp.FSDP)")
        self.model, self.comm, self.stage, self.overlap = model, comm, stage, overlap
        self.max_in_flight = max_in_flight
        named = model.named_parameters()
        if stage == 1:
            self.groups = [Group(named, comm)]
        elif stage == 2:
            buckets = assign_buckets([p.data.nbytes for _, p in named], bucket_bytes)
            self.groups = [Group([named[i] for i in sorted(b)], comm) for b in buckets]
        else:
            self.units = units                      # fsdp.Units: the model's units, already sharded
            self.groups = self.units.groups
            self.units.on_grad = self._note_grads   # a unit's full gradients, just before its reduce
        for g in self.groups:                      # lesson 10: reduce-scatter 16-bit gradients
            g.reduce_dtype = reduce_dtype
        self.inner = sharded_adamw(opt, self.groups)
        self.param_groups = self.inner.param_groups
        self.offload = offload_module.make(offload, self.inner, self.groups, MPI.COMM_WORLD.Get_rank(), stage,
                                           offload_dir, chunk_bytes)
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

    def store_grads(self):
        """Nothing: the reduced partitions are where the step reads them."""

    def state_bytes(self):
        return self.inner.state_bytes()

    def step(self):
        """AdamW on my pieces, then (stages 1, 2) all-gather the updated weights."""
        self.held_grad_bytes = self.grad_bytes()   # what the update reads (or keeps) now
        (self.offload or self.inner).step()
        if self.stage < 3:
            for g in self.groups:
                mine = g.flat_data()[g.lo:g.hi]
                g.write_back(ring_all_gather(self.comm, mine))

    # -- offload: the files and what moved through them
    def offload_bytes(self):
        """{"bytes_read", "bytes_written", "steps"}: what the optimizer steps moved through
        the offload files so far (plus, in bytes_written, stage 3's shards written once when
        this object was built); zeros without offload."""
        if self.offload is None:
            return {"bytes_read": 0, "bytes_written": 0, "steps": 0}
        return dict(self.offload.store.stats)

    def close(self):
        """Remove the offload files (nothing to do without offload)."""
        if self.offload is not None:
            self.offload.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

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
        reduce_grads(self.comm, g)                  # FSDP's units reduce the same way
        self._note_grads()

    def sync(self):
        if self.stage == 1:
            self._note_grads()
            g = self.groups[0]
            # stage 1 keeps the whole local gradient until the step (DeepSpeed's stage 1 too)
            g.add_grad(reduce_scatter_grad(self.comm, g.flat_grads(drop=False)))
            self._note_grads()

    def named_grads(self, model=None):
        """My partition's gradients, as (name[a:b], piece) pairs: what the run is compared on."""
        return [(name, q) for g in self.groups for name, q in zip(g.names_of_pieces, g.pieces)]

    def grad_norm_sq(self, held):
        """The whole gradient's squared norm: my pieces' squares, summed over ranks (MPI's
        own Allreduce of one float64: bookkeeping, not counted with the stage's traffic)."""
        mine = np.array([grad_norm_sq(held)])
        out = np.empty(1)
        self.comm.Allreduce(mine, out, op=MPI.SUM)
        return float(out[0])

    # -- what a checkpoint saves and loads of this rank (minidist/checkpoint/layouts.py)
    def checkpoint_pieces(self, model=None, opt=None):
        """(pieces, states): my partition of every parameter, a flat range [a, b) of it in
        C order, for the weights and AdamW's m and v alike; states: AdamW's per piece."""
        out, states = [], []
        shapes = {n: tuple(sh) for g in self.groups for n, sh in zip(g.names, g.shapes)}
        for g in self.groups:
            for q, _, name, a, b in g.spans():
                region = {"flat": [a, b]}
                out.append(Held(f"model.{name}", shapes[name], region, q.data.reshape(-1)))
                st = self.inner.state.get(id(q))
                states.append(st)
                if st is not None:
                    out.append(Held(f"optim.exp_avg.{name}", shapes[name], region, st["exp_avg"].reshape(-1)))
                    out.append(Held(f"optim.exp_avg_sq.{name}", shapes[name], region,
                                    st["exp_avg_sq"].reshape(-1)))
        return out, states

    def checkpoint_tensors(self, model=None):
        """[(name, global shape, dtype)] of every parameter I hold part of."""
        return [(n, tuple(sh), g.dtype) for g in self.groups for n, sh in zip(g.names, g.shapes)]

    def checkpoint_optimizer(self, opt=None):
        """The optimizer whose state a checkpoint fills: my pieces' AdamW."""
        return self.inner

    def checkpoint_params(self, model=None, opt=None):
        """The tensors AdamW keeps state for: my pieces."""
        return [q for g in self.groups for q in g.pieces]

    def checkpoint_loaded(self):
        """Stages 1 and 2: the whole weights on every rank, as after a step."""
        if self.stage < 3:
            for g in self.groups:
                g.write_back(ring_all_gather(self.comm, g.flat_data()[g.lo:g.hi]))

    def checkpoint_layout(self, model=None):
        return f"zero{self.stage}"

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
        if self.offload is not None:        # offloaded: in files, not in memory; "disk" says how much
            return {"params": params, "grads": self.held_grad_bytes, "optimizer": 0,
                    "disk": sum(self.offload.store.file_bytes().values())}
        if self.stage == 3:
            params += sum(g.shard.nbytes for g in self.groups)
        return {"params": params, "grads": self.held_grad_bytes, "optimizer": self.state_bytes()}

    def named_weights(self, model=None):
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


# ----------------------------------------------------------------------------- bytes, from the groups' sizes


def expected_sent(zero, micro_batches=1):
    """Bytes this rank sends per step, {collective: bytes}: plan.traffic.zero_sent of this
    object's flat groups (their sizes, the dtype their gradients are reduced in, the dtype
    their weights are gathered in), counted chunk by chunk: what the measurement must
    equal exactly. The paper's count is plan.traffic.zero_bytes; its memory accounting
    plan.memory.engine_state_bytes."""
    reshard = zero.stage == 3 and zero.units.reshard
    return zero_sent(zero.stage, flat_groups(zero), zero.comm.Get_size(), zero.comm.Get_rank(), micro_batches,
                     reshard)


def flat_groups(zero):
    """[(elements, reduce itemsize, gather itemsize)] of zero's flat buffers, in order: what
    plan.traffic.zero_sent counts (gradients travel in the reduce dtype, weights in theirs)."""
    return [(g.n, np.dtype(g.reduce_dtype or g.dtype).itemsize, g.shard_itemsize) for g in zero.groups]
