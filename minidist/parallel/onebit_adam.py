"""1-bit Adam (Tang et al. 2021; DeepSpeed's deepspeed/runtime/fp16/onebit/adam.py): after a
warm-up, the Adam MOMENTUM is averaged over ranks in 1 bit per value, not the gradient.

sync() (CompressedDataParallel(model, comm, "1bit-adam", warmup_steps=w)) sends fp32
gradients during the warm-up and nothing after it; OneBitAdam then updates each worker's
momentum with its own gradient and averages the momenta with compressed_allreduce:
the two-phase exchange of minidist/parallel/compression.py on sign codes, with
DeepSpeed's scales (one per worker over the whole buffer, one per server chunk) and error
feedback on both sides. Bytes: plan.traffic.onebit_adam_sent. (Lesson 10 measures it
beside "1bit", 1-bit GRADIENTS with error feedback.)

On a device the momentum, the residuals and the codes stay on it (compressors.ns picks
the array module); only the packed messages cross, staged by the comm layer for MPI.
"""
import math

import numpy as np

from minidist.backend import xp
from minidist.comm import all_to_all_v, chunk_bounds, ring_all_gather
from minidist.parallel.compressors import ns, onebit_decompress, pack, scalar, unpack, unpack_bits


def scaled_sign(v):
    """DeepSpeed's 1-bit code of a buffer: (signs packed 8 per byte, scale) with ONE scale,
    ||v||_2 / sqrt(n) (deepspeed/runtime/comm/nccl.py, compressed_allreduce: worker_scale
    and server_scale); a zero counts as +. Decompress with onebit_decompress. (The mean
    |v| of onebit_compress, exercise 10.3, is the scale that minimises the L2 error; the
    root mean square is DeepSpeed's, and what 1-bit Adam here uses.)"""
    m = ns(v)
    v = m.asarray(v)
    scale = scalar(m.linalg.norm(v) / np.sqrt(v.size) if v.size else m.zeros((), v.dtype), v.dtype)
    return m.packbits(v >= 0), scale


def compressed_allreduce(comm, x, worker_error, server_error):
    """1-bit Adam's average of x over ranks (Tang et al. 2021, Algorithm 1; DeepSpeed's
    compressed_allreduce), with error feedback on both sides; returns a new array, the
    same on every rank. worker_error (len x) and server_error (len of this rank's chunk,
    minidist.comm.chunk_bounds) are updated in place.

      worker: v = x + worker_error; one scale s over ALL of v; worker_error = v - s sign(v);
              chunk j of sign(v), packed, goes to rank j with s       (all_to_all_v)
      server: rank j averages the N decoded pieces of chunk j, adds server_error, codes
              that with one scale of its own; server_error keeps what the code missed;
              every server's chunk reaches every rank                 (ring_all_gather)
    Each message is [scale, packed signs]: bytes plan.traffic.onebit_adam_sent."""
    N, me = comm.Get_size(), comm.Get_rank()
    m = ns(x)
    dt = m.asarray(x).dtype
    v = m.asarray(x) + worker_error
    bits, s = scaled_sign(v)
    worker_error[...] = v - m.where(v >= 0, s, -s)
    b = chunk_bounds(v.size, N)
    signs = unpack_bits(bits, v.size)
    got = all_to_all_v(comm, [pack(s, m.packbits(signs[b[j]:b[j + 1]]), dt) for j in range(N)])
    mine, avg = b[me + 1] - b[me], 0
    for msg in got:                                   # every worker's piece of my chunk
        scale, payload = unpack(msg, dt)
        avg = avg + onebit_decompress(payload, scale, mine)
    avg = avg / N
    c = avg + server_error
    bits, s = scaled_sign(c)
    server_error[...] = c - m.where(c >= 0, s, -s)
    joined = ring_all_gather(comm, pack(s, bits, dt))
    out, at, k = m.empty(v.size, dt), 0, dt.itemsize
    for j in range(N):
        length = k + -(-(b[j + 1] - b[j]) // 8)
        scale, payload = unpack(joined[at:at + length], dt)
        out[b[j]:b[j + 1]] = onebit_decompress(payload, scale, b[j + 1] - b[j])
        at += length
    return out


class OneBitAdam:
    """1-bit Adam (Tang et al. 2021), around an optim.AdamW and a
    CompressedDataParallel(model, comm, "1bit-adam", warmup_steps=w):

        opt = OneBitAdam(model.configure_optimizers(0.1, lr), dp)

    The first w steps are plain AdamW on the fp32 all-reduced gradient (the dp slot's sync).
    Then AdamW's variance v is frozen (the paper's finding: after a warm-up v is stable
    enough to serve as a fixed preconditioner), the dp slot stops sending gradients, and
    every step each worker updates its momentum with its OWN gradient, m = b1 m + (1 - b1)
    g_local, and the momenta are averaged by compressed_allreduce (1 bit per value, error
    feedback on worker and server); every rank's m becomes that average, and the update m /
    (sqrt(v) + eps) follows: the same on every rank, so the replicas stay equal. What is
    compressed is the momentum, not the gradient: with v frozen the update is linear in m,
    which is what makes error feedback's "nothing lost, only delayed" hold for the update
    itself.

    As DeepSpeed (deepspeed/runtime/fp16/onebit/adam.py): the freeze after `freeze_step`
    steps, the momentum all-reduced compressed, the update from the frozen v. This
    project's choices: the momenta of all parameters in one flat buffer (DeepSpeed
    compresses each flat buffer its fp16 optimizer hands it); AdamW's bias corrections and
    decoupled weight decay kept (DeepSpeed's update has no bias correction); gradient
    clipping (train_step) clips each worker's own gradient in the compressed phase; a
    parameter that no warm-up step gave a gradient has no v and is not updated.
    A checkpoint keeps the frozen v's step (minidist/checkpoint/layouts.py, optim.v_step).

    Every attribute this class does not define (zero_grad, set_lr, state, state_bytes, ...)
    is the inner AdamW's: __getattr__ forwards it, so the wrapper is used as the AdamW it holds.
    """

    def __init__(self, inner, dp):
        if dp.code.exchange != "momentum":
            raise ValueError(f"OneBitAdam needs a '1bit-adam' dp slot, not {dp.compressor!r}")
        self.inner, self.dp = inner, dp
        self.param_groups = inner.param_groups

    def __getattr__(self, name):          # zero_grad, set_lr, state, state_bytes, ...: AdamW's
        return getattr(self.inner, name)

    def step(self):
        if not self.dp.compressing:
            return self.inner.step()
        if not self.inner.variance_frozen:
            self.inner.freeze_variance()
        # A parameter without AdamW state had no gradient in any warm-up step: it has no v to
        # precondition with, so it is not updated (as AdamW skips one without a gradient); its
        # place in the flat buffer (the dp slot's residuals cover every parameter) holds zeros.
        # Which parameters have state is the same on every rank: the warm-up's gradients are
        # the all-reduced ones.
        items = [(g, p) for g in self.param_groups for p in g["params"]]
        live = [id(p) in self.inner.state for _, p in items]
        if not any(live):
            raise ValueError("OneBitAdam: no parameter has AdamW state after the warm-up (it needs "
                             "warmup_steps 1 or more, with gradients): no variance to freeze")
        for (g, p), ok in zip(items, live):                 # 1. each worker's own momentum
            if not ok:
                continue
            b1 = g["betas"][0]
            s = self.inner.state[id(p)]
            s["step"] += 1
            m = s["exp_avg"]
            m *= b1
            if p.grad is not None:
                m += (1.0 - b1) * xp.asarray(p.grad)
        # 2. the momenta averaged in 1 bit, with error feedback
        flat = xp.concatenate([self.inner.state[id(p)]["exp_avg"].reshape(-1) if ok
                               else xp.zeros(p.data.size, self.dp.dtype)
                               for (_, p), ok in zip(items, live)])
        avg, at = self.dp.allreduce_momentum(flat), 0
        for (g, p), ok in zip(items, live):                 # 3. AdamW's update, v frozen
            at += p.data.size
            if not ok:
                continue
            lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            s = self.inner.state[id(p)]
            m = s["exp_avg"]
            m[...] = avg[at - m.size:at].reshape(m.shape)
            if wd:
                p.data *= 1.0 - lr * wd
            denom = xp.sqrt(s["exp_avg_sq"]) * (1.0 / math.sqrt(1.0 - b2 ** s["v_step"])) + eps
            p.data -= (lr / (1.0 - b1 ** s["step"])) * (m / denom)
