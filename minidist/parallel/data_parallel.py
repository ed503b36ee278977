"""Data parallelism: every rank holds the whole model and trains on its own slice of the
global batch; after backward the gradients are averaged across ranks, so every replica
takes the same optimizer step and the replicas stay identical.

    mpirun -n 4 python -m minidist.lessons.02_data_parallel
    mpirun -n 4 python -m minidist.lessons.02_data_parallel --naive --grad-accum 2

Communication per step: one all-reduce of all gradients, 2(N-1)/N x (gradient bytes)
sent per rank with the ring (docs/reference.md#data-parallelism). Memory: none saved; every rank holds the
full parameters, gradients and optimizer state (ZeRO, a lesson still to come, shards them).

Two versions, both kept, the difference being the lesson:
- `NaiveDataParallel`: after backward, all-reduce each parameter's gradient in turn.
  Simple, but the network idles during backward and the CPU idles during communication.
- `BucketedDataParallel`, as PyTorch DDP does it: gradients are packed into flat buckets
  in reverse parameter order (roughly the order backward produces them); a bucket's
  all-reduce starts the moment its last gradient is ready, with non-blocking ring steps
  that advance between the backward's ops, so most of the communication hides behind
  the rest of backward. Fewer, larger messages also pay the per-message latency less.

Both average (sum, then divide by N), and both have `no_sync()`: during gradient
accumulation the first k-1 micro-batches only accumulate locally (PyTorch's no_sync).

On a device (MINIDIST_DEVICE=cuda, or the strict double) the buckets are device arrays
made with xp, beside the gradients; the comm layer stages each all-reduce through host
memory unless MPI is CUDA-aware (comm/staging.py): 2 M across PCIe per step for M bytes
of gradients, this project's design. Only replica_checksums brings weights home itself.
"""
import contextlib
import time
import weakref
import zlib

import numpy as np

from minidist.backend import to_numpy, xp
from minidist.comm import all_reduce, broadcast, ring_all_reduce_start
from minidist.plan.rules import assign_buckets   # exercise 2.2's answer, the planner's too
from minidist.parallel.strategy import Strategy
from minidist.tensor import backward_step_callback


# model -> the BucketedDataParallel whose grad-ready hooks are on its parameters
_HOOKED = weakref.WeakKeyDictionary()


def broadcast_parameters(model, comm, root=0):
    """Make every replica start from rank root's weights (in place)."""
    for p in model.parameters():
        p.data[...] = broadcast(comm, p.data, root)


def replica_checksums(model, comm):
    """A CRC of this rank's parameter bytes, gathered from every rank (MPI's own gather).

    Replicas that stayed identical give one value everywhere: a check that costs one
    small message, used at the end of the lesson. On a device the weights come home
    first (to_numpy: counted, once, after training): a CRC is host arithmetic.
    """
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(np.ascontiguousarray(to_numpy(p.data)).tobytes(), crc)
    out = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([crc], dtype=np.int64), out)
    return out


def average_gradients(comm, grads):
    """The mean of each gradient over all ranks: a ring all-reduce (sum), then / N.

    Returns new arrays; the inputs are left as they are. (Exercise 2.1.)
    """
    n = comm.Get_size()
    return [all_reduce(comm, g, op="sum") / n for g in grads]


class NaiveDataParallel(Strategy):
    """All-reduce every gradient after backward, one parameter at a time."""

    def __init__(self, model, comm):
        self.model, self.comm = model, comm
        self.params = list(model.parameters())

    def __call__(self, *args, **kw):
        return self.model(*args, **kw)

    # backward_context: Strategy's (nothing); the naive version communicates only in sync()

    def sync(self):
        """Average gradients across ranks: a ring all-reduce per parameter, then / N."""
        grads = [p.grad if p.grad is not None else xp.zeros_like(p.data) for p in self.params]
        for p, g in zip(self.params, average_gradients(self.comm, grads)):
            p.grad = g


class Bucket:
    """A flat buffer holding several parameters' gradients, all-reduced as one message."""

    def __init__(self, index, params, dtype):
        self.index, self.params = index, params
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.data.size
        self.flat = xp.zeros(off, dtype=dtype)     # on the device with the gradients
        self.ready = 0                 # parameters whose gradient has been copied in
        self.handle = None             # the in-flight ring all-reduce

    @property
    def nbytes(self):
        return self.flat.nbytes


class BucketedDataParallel(Strategy):
    """PyTorch DDP's recipe: buckets in reverse parameter order, each all-reduced as soon
    as it is full, overlapping the rest of backward."""

    def __init__(self, model, comm, bucket_bytes=25 * 2**20, reduce_dtype=None):
        self.model, self.comm = model, comm
        self.params = list(model.parameters())
        self.names = {id(p): n for n, p in model.named_parameters()}
        # reduce_dtype: mixed precision's 16-bit gradients (lesson 10) travel and are summed
        # in 16 bits: half the bytes of fp32 (minidist/precision.py)
        dtype = reduce_dtype or self.params[0].data.dtype
        # the last layers' gradients are ready first in backward, so the first bucket
        # (filled from the last parameters) can start while backward is still running
        groups = assign_buckets([p.data.nbytes for p in self.params], bucket_bytes)
        self.buckets = [Bucket(i, [self.params[j] for j in g], dtype) for i, g in enumerate(groups)]
        self.where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # one wrapper's hooks per model: wrapping the same model again (the lesson times a
        # naive and a bucketed run on one model; later lessons re-wrap models) takes the
        # previous wrapper's hooks off first, instead of stacking a dead hook per wrap
        previous = _HOOKED.get(model)
        if previous is not None:
            previous.remove_hooks()
        self.hooks = [p.register_grad_ready_hook(self._grad_ready) for p in self.params]
        _HOOKED[model] = self
        self.communicating = False
        self.next_to_start = 0         # buckets start strictly in index order on every rank
        self.timeline = {}             # times of the last step, for the lesson's picture

    def __call__(self, *args, **kw):
        return self.model(*args, **kw)

    def remove_hooks(self):
        """Take this wrapper's grad-ready hooks off the parameters (it can no longer sync)."""
        for h in self.hooks:
            h.remove()
        self.hooks = None
        if _HOOKED.get(self.model) is self:
            del _HOOKED[self.model]

    # -- during backward
    @contextlib.contextmanager
    def backward_context(self, last):
        """Wrap one micro-batch's backward; communication happens only in the last one."""
        if self.hooks is None:
            raise RuntimeError("this BucketedDataParallel's hooks were removed (the model was wrapped "
                               "again, or remove_hooks() was called): use the newer wrapper")
        if not last:
            yield                       # no_sync: gradients only accumulate locally
            return
        self.communicating = True
        self.next_to_start = 0
        for b in self.buckets:
            b.ready, b.handle = 0, None
        self.timeline = {"backward_start": time.perf_counter()}
        with backward_step_callback(self._progress):
            yield
        self.timeline["backward_end"] = time.perf_counter()

    def _grad_ready(self, p):
        """A gradient is complete: copy it into its bucket; start the buckets that are full."""
        if not self.communicating:
            return
        b, i = self.where[id(p)]
        b.flat[b.offsets[i]:b.offsets[i] + p.data.size] = p.grad.reshape(-1)
        b.ready += 1
        self._start_full_buckets()

    def _start_full_buckets(self):
        # start in index order only, so every rank posts the same all-reduces in the same order
        while self.next_to_start < len(self.buckets):
            b = self.buckets[self.next_to_start]
            if b.ready < len(b.params):
                break
            b.handle = ring_all_reduce_start(self.comm, b.flat, op="sum")
            self.next_to_start += 1

    def _progress(self):
        """Called between backward ops: let the in-flight ring steps move on."""
        for b in self.buckets[:self.next_to_start]:
            if b.handle is not None:
                b.handle.test()

    # -- after backward
    def sync(self):
        """Wait for every bucket, then write the averaged gradients back into .grad."""
        t0 = time.perf_counter()
        for b in self.buckets[self.next_to_start:]:
            # a parameter that took no part in the last backward never fired its hook:
            # (re)fill the bucket from .grad, zeros where there is none, and start it
            for p, off in zip(b.params, b.offsets):
                b.flat[off:off + p.data.size] = 0 if p.grad is None else p.grad.reshape(-1)
            b.ready = len(b.params)
        self._start_full_buckets()
        n = self.comm.Get_size()
        for b in self.buckets:
            reduced = b.handle.wait()
            for p, off in zip(b.params, b.offsets):
                p.grad = (reduced[off:off + p.data.size] / n).reshape(p.data.shape)
        self.communicating = False
        t = self.timeline
        t["sync_start"], t["sync_end"] = t0, time.perf_counter()
        t["buckets"] = [(b.index, b.nbytes, len(b.params), b.handle.t_start, b.handle.t_end)
                        for b in self.buckets]
