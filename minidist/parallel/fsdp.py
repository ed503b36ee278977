"""FSDP (Zhao et al. 2023, arXiv 2304.11277): ZeRO stage 3 unit by unit, PyTorch's way.

    mpirun -n 4 python -m minidist.lessons.06_fsdp
    mpirun -n 4 python -m minidist.lessons.06_fsdp --no-reshard --no-prefetch

The model is cut into units: one per transformer block, and the root unit with the rest
(token and position tables, the last layer norm; the output head is the token table).
Each unit's parameters lie end to end in one flat buffer cut as numpy.array_split cuts
it; a rank keeps its shard only (1/N of the unit). Around each block:

    forward:   all-gather the unit -> compute -> free (reshard_after_forward)
    backward:  all-gather it again -> compute -> reduce-scatter its gradients -> free

The root unit is gathered when the model's forward starts and freed once its gradients
are reduced: its tables are used first in forward and last in backward (the head, tied
to the token table, is the first op of backward), so resharding it would only gather
it back at once (PyTorch's FSDP keeps its root unit too).

Values sent per rank per micro-batch, ring factor (N-1)/N: all-gather Psi forward, Psi_blocks
backward (none with reshard_after_forward=False), reduce-scatter Psi. Parameter memory:
my shards (Psi/N) plus the gathered units: the root and one block (two while a prefetch
is in flight; all of them without resharding).

`prefetch=True` starts the next unit's all-gather (non-blocking, the ring's second phase
alone: comm.nonblocking.RingAllGather) when a unit starts, so it travels while the unit
computes; backward's ops call test() in between (MPI moves data only inside MPI calls).

This file holds the units; the optimizer and train_step's slot are zero.ZeRO's (FSDP
is `ZeRO(..., stage=3, units=Units(...))` with the units' choices). Layout: the flat sharded
buffer (Group), gather_params, free_params and the reduce-scatter live in
parallel/flat_shards.py, below this file and zero.py. Stage 3 is these units under ZeRO's
optimizer, so this file imports zero.py (for FSDP) and zero.py never imports this one: it
takes the units as an argument. Each file keeps one topic: zero.py the sharded optimizer,
this one when units are gathered and freed. Flat buffers rather than each
parameter split along dim 0 (FSDP2): one message per unit, and the same partitioning as
stages 1 and 2, so one exercise covers both.

On a device the shards and gathered units are device arrays (flat_shards.py). On the
staged path (MPI without CUDA support, comm/staging.py) a prefetch's ring runs in a host
buffer and its unit reaches the device at wait(); the bytes _measure counts are the same.
"""
import contextlib
import time

from minidist import context
from minidist.comm.nonblocking import ring_all_gather_start
# the flat sharded buffer and the exercises' answers 6.1 and 6.2, re-exported under these
# names (fsdp.gather_params, fsdp.free_params: the very same objects)
from minidist.parallel.flat_shards import Group, free_params, gather_params, reduce_grads
from minidist.parallel.zero import ZeRO
from minidist.tensor import Function, backward_step_callback

def FSDP(model, opt, comm, reshard_after_forward=True, prefetch=True, **zero_kw):
    """The optimizer and train_step's slot of an FSDP run: ZeRO stage 3 over these units.
    zero_kw: ZeRO's other options (offload="disk", offload_dir=...: parallel/offload.py)."""
    return ZeRO(model, opt, comm, stage=3, units=Units(model, comm, reshard_after_forward, prefetch), **zero_kw)


class PreBackward(Function):
    """Identity forward; backward gathers the unit that produced x before its backward runs
    (every node of the unit runs after this one in backward: they all made x)."""

    @staticmethod
    def forward(ctx, x, units=None, u=None):
        ctx.units, ctx.u = units, u
        return x.view()

    @staticmethod
    def backward(ctx, grad):
        ctx.units.before_backward(ctx.u)
        return grad


class Units:
    """The units of a GPT, their shards, and when they are gathered and freed."""

    def __init__(self, model, comm, reshard_after_forward=True, prefetch=False):
        self.comm, self.reshard, self.prefetch = comm, reshard_after_forward, prefetch
        blocks = list(model.transformer.h)
        prefixes = [f"transformer.h.{i}." for i in range(len(blocks))]
        named = model.named_parameters()
        per_block = [[(n, p) for n, p in named if n.startswith(pre)] for pre in prefixes]
        root = [(n, p) for n, p in named if not any(n.startswith(pre) for pre in prefixes)]
        self.groups = [Group(root, comm, shard=True)] + [Group(b, comm, shard=True) for b in per_block]
        self.names = ["root"] + [f"block {i}" for i in range(len(blocks))]
        for g in self.groups:
            free_params(g)
            for p in g.params:
                context.ON_DEMAND.add(p)
        self.unit_of = {id(p): u for u, g in enumerate(self.groups) for p in g.params}
        self.hooks = [model.register_forward_hooks(pre=lambda m, a: self.gather(0))]
        for i, blk in enumerate(blocks):
            self.hooks.append(blk.register_forward_hooks(
                pre=lambda m, a, u=i + 1: self.before_forward(u),
                post=lambda m, a, out, u=i + 1: self.after_forward(u, out)))
        self.hooks += [p.register_grad_ready_hook(self._grad_ready) for _, p in named]
        self.gathered, self.handles = {}, {}
        self.live = self.peak = 0              # bytes of gathered parameters, now and at most
        self.on_grad = lambda: None            # ZeRO notes its gradient bytes here (before a reduce)
        self.events = []                       # (unit, what, t0, t1) for the timeline
        self.pending = {}

    # -- gather and free, with the bookkeeping the lesson prints
    def gather(self, u, why="gather"):
        if u in self.gathered:
            return
        t0 = time.perf_counter()
        g = self.groups[u]
        if u in self.handles:                 # a prefetch brought it (or is bringing it)
            full = self.handles.pop(u).wait()
            g.point(full)
            why = "wait"
        else:
            full = gather_params(self.comm, g)
        self.gathered[u] = full
        self._measure()
        self.events.append((u, why, t0, time.perf_counter()))

    def _measure(self):
        """Bytes of gathered parameters alive now, read from what the parameters point at
        (the buffers behind their arrays, each counted once) and the buffers prefetches are
        filling: a unit whose parameters were never freed still counts."""
        behind = {}
        for g in self.groups:
            for p in g.params:
                if p.data.size:
                    buf = p.data if p.data.base is None else p.data.base
                    behind[id(buf)] = buf.nbytes
        self.live = sum(behind.values()) + sum(h.out.nbytes for h in self.handles.values())
        self.peak = max(self.peak, self.live)

    def start_prefetch(self, u):
        if 0 < u < len(self.groups) and u not in self.gathered and u not in self.handles:
            g = self.groups[u]
            self.handles[u] = ring_all_gather_start(self.comm, g.shard, g.n)
            self._measure()
            self.events.append((u, "prefetch", time.perf_counter(), time.perf_counter()))

    def free(self, u):
        if u not in self.gathered:
            return
        full = self.gathered.pop(u)
        free_params(self.groups[u])
        del full
        self._measure()
        self.events.append((u, "free", time.perf_counter(), time.perf_counter()))

    # -- the hooks
    def before_forward(self, u):
        self.gather(u)
        if self.prefetch:
            self.start_prefetch(u + 1)

    def after_forward(self, u, out):
        if self.reshard:
            self.free(u)
        return PreBackward.apply(out, units=self, u=u)

    def before_backward(self, u):
        self.gather(u, "gather (backward)")
        if self.prefetch:
            self.start_prefetch(u - 1)

    def _progress(self):
        for h in self.handles.values():
            h.test()

    @contextlib.contextmanager
    def backward_context(self):
        self.pending = {u: len(g.params) for u, g in enumerate(self.groups)}
        with backward_step_callback(self._progress) if self.prefetch else contextlib.nullcontext():
            yield

    def _grad_ready(self, p):
        u = self.unit_of[id(p)]
        self.pending[u] -= 1
        if self.pending[u] == 0:              # the unit's backward is over
            self.on_grad()
            t0 = time.perf_counter()
            reduce_grads(self.comm, self.groups[u])
            self.events.append((u, "reduce-scatter", t0, time.perf_counter()))
            self.free(u)

    def remove_hooks(self):
        for h in self.hooks:
            h.remove()
