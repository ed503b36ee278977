"""Gradient compression for data parallelism: send fewer bytes per step, keep what was
not sent for later (error feedback), and still converge.

    dp = CompressedDataParallel(model, comm, "1bit", warmup_steps=100)
    train_step(model, optimizer, batches, lr, dp=dp)      # minidist/train.py's dp slot

Plain data parallelism sends 2(N-1)/N x (gradient bytes) per rank per step (a ring
all-reduce of fp32 gradients). The compressors here send less:

    compressor   what travels                                  bytes per rank, n gradients
    none         the fp32 gradients                            2(N-1)/N x 4n
    fp16         the gradients / N, cast to float16            2(N-1)/N x 2n
    int8         int8 codes + one scale per tensor in a chunk  ~2(N-1)/N x n
    1bit         signs packed 8 per byte + one scale per chunk ~2(N-1)/N x n/8
    1bit-adam    the Adam MOMENTUM's signs + one worker scale  ~2(N-1)/N x n/8
                 and one server scale per chunk (OneBitAdam)
    powersgd     two thin matrices P (n x r), Q (m x r)         2(N-1)/N x 4r(n+m) per n x m matrix

(exact formulas, with numpy.array_split's uneven chunks and the scales: `bytes_formula`;
1bit-adam's: plan.traffic.onebit_adam_sent.)

Two 1-bit variants, which is which:
- "1bit", 1-bit GRADIENTS with error feedback (this project's variant, after Seide et al.
  2014, on 1-bit Adam's two-phase collective): the gradient is compressed in sync(),
  and the optimizer (AdamW, its variance frozen after the warm-up) gets the
  decompressed average gradient;
- "1bit-adam", 1-bit ADAM as Tang et al. 2021 and DeepSpeed do it: sync() sends fp32
  gradients during the warm-up and nothing after it; OneBitAdam updates each worker's
  momentum with its own gradient and averages the momenta with compressed_allreduce
  (DeepSpeed's scales: one per worker over the whole buffer, one per server chunk).

fp16: the sum of float16 numbers is a float16 number, so the ring all-reduce (a
reduce-scatter that adds hop by hop, then an all-gather) works unchanged. Each rank
divides by N *before* the cast, so every partial sum of the ring is at most the largest
|gradient| of any rank: it overflows float16 (above 65504) only if a gradient itself
does, never because N gradients were added. Values below 6e-5 lose precision (float16's
subnormals); the relative error per element is about (N+1) x 2^-11.

int8 and 1bit: the sum of two int8 codes (with their own scales) or of two sign vectors
is neither, so a ring cannot add them hop by hop. 1-bit Adam's two-phase scheme instead:

    phase 1 (a reduce-scatter of compressed pieces): cut the flat gradient into N chunks
      (minidist.comm.chunk_bounds), compress each chunk (with its own scales), send chunk j
      to rank j (all_to_all_v); rank j decompresses the N pieces of chunk j it holds and
      averages them. Sends (N-1)/N x (compressed bytes).
    phase 2 (an all-gather of compressed chunks): rank j compresses its averaged chunk
      again and ring_all_gather brings every rank all N compressed chunks, which every
      rank decompresses. Sends (N-1)/N x (compressed bytes) again.

Together 2(N-1)/N x (compressed size): 1/4 of fp32 for int8, 1/32 for 1 bit (plus the
scales).

Scales: one scale per parameter tensor within each chunk (scales="tensor", int8's
default), or one per chunk (scales="chunk", 1 bit's default: measured below). The flat vector is the parameters end to end, so a chunk spans many tensors whose
gradients differ in size by orders (the embeddings', the layer norms', the attention
weights'); one scale for all of them quantizes the small ones to almost nothing (int8)
or gives them the large ones' magnitude (1 bit). So each chunk is cut at the parameter
boundaries inside it into segments (a segment: the intersection of a chunk with one
parameter tensor), and each segment is compressed on its own, with its own scale (1 bit:
with its own slice of the residual); the segments of one chunk travel in ONE message,
[scale, payload] after [scale, payload], so the collectives are the same two. Phase 2
likewise compresses each segment of the rank's own chunk. The message of chunk j is

    sum over the segments s of chunk j of  (k + payload(len s))
    k = the gradients' itemsize (the scale),  payload(m) = m (int8), ceil(m / 8) (1 bit)

(1 bit rounds up per segment, so each segment costs at most one byte of padding more),
and rank `me` sends every chunk's message but its own in phase 1 and every one but its
right neighbour's in phase 2: sum_j msg_j - msg_me + sum_j msg_j - msg_(me+1 mod N).
With S segments in all (about N + the number of tensors) that is 2(N-1)/N x (compressed
bytes + k S) on average. scales="chunk" keeps one scale per chunk (S = N: an empty
chunk is still one message of a lone scale); in "tensor" an empty chunk has no segment
and sends nothing. Measured in lesson 10 (4 ranks, 200 steps, gap to fp32's validation
loss; the lesson's table has each compressor's default, the other choice is the lesson
run with `scales=` flipped): int8 about +3.1% with one scale per chunk, about +0.6% with
one per tensor; 1-bit gradients (50 warm-up steps, AdamW's variance frozen) about +7.7%
per chunk, about +9.0% per tensor (--seed 1: about +6.4%, +7.0%), so 1 bit keeps one
scale per chunk unless told otherwise. (1-bit Adam, same bytes: about +1.2%, lesson 10.)

The obvious alternative, an all-gather of every rank's whole compressed
vector, makes each rank forward N-1 whole vectors: (N-1) x C bytes, against
2(N-1)/N x C for the two phases, N/2 times more. It ties at N = 2 and loses from N = 3
on. Against fp32's ring all-reduce (2(N-1)/N x 32C at 1 bit, C = n/8 bytes) it sends
N/64 of the bytes: still a gain up to 64 ranks, but the two-phase scheme's 2/64 is
better from N = 3 (for int8, N/8 against 2/8).

Error feedback. A compressor that throws information away every step would bias the
descent; error feedback keeps what was not sent (the residual) and adds it to the next
step's gradient, so nothing is lost, only delayed: over a run, the sum of the applied
gradients equals the sum of the true average gradients minus the residual still held
(tests/mpi/test_compression.py checks that every step).
- Seide et al. 2014, "1-bit stochastic gradient descent and its application to
  data-parallel distributed training of speech DNNs": signs of (gradient + residual)
  with one scale, the quantization error carried to the next step.
- Tang et al. 2021, "1-bit Adam": a warm-up of uncompressed steps (here `warmup_steps`,
  fp32 ring all-reduce), then the two-phase scheme above on the MOMENTUM, with error
  feedback on both sides: each worker keeps a residual of its whole vector (phase 1),
  each rank as the "server" of its chunk keeps a residual of that chunk (phase 2).
  "1bit" borrows the scheme and both residuals for the gradient; "1bit-adam" is the
  paper's algorithm (OneBitAdam, compressed_allreduce).
- Vogels et al. 2019, "PowerSGD": a gradient matrix M (n x m) is approximated by
  P Q^T of rank r: P = M Q, all-reduced, orthogonalized; Q = M^T P, all-reduced;
  one power iteration per step, with Q reused from the previous step (a warm start
  that makes one iteration enough). Every rank's M includes its error feedback, and its
  new error is M minus the averaged approximation (PyTorch's powerSGD hook's rule; the
  ranks' mean error is the same as with each rank's own P P^T M subtracted, so the sum
  rule above holds either way). The P's of all matrices travel in one
  all-reduce, the Q's in another; vectors (biases, layer-norm weights) are small and
  go uncompressed, in one more all-reduce, as the paper and PyTorch's hook do.
  One addition of ours: when a step's summed M has rank below r, Gram-Schmidt zeroes
  the dependent columns of P, hence of Q, and the warm start would keep them zero for
  ever; such a column of Q is drawn again (from `seed`, the same on every rank).

The warm-up (`warmup_steps` uncompressed syncs) applies to every compressor; with
`bucket_bytes` the flat compressors work bucket by bucket, each with its own chunks
and scales, and its own pair of collectives (PowerSGD takes none: it batches all
matrices into one all-reduce).

The pure functions (onebit_compress, int8_compress, orthogonalize, powersgd_step, ...)
are exercises; CompressedDataParallel calls them through this module's globals, so a
student's version plugged in as `compression.onebit_compress = mine` is the one used.
Data moves only through minidist.comm's hand-written collectives.
"""
import contextlib
import math

import numpy as np

from minidist.backend import to_numpy, xp
from minidist.comm import all_to_all_v, chunk_bounds, ring_all_gather, ring_all_reduce, stats
from minidist.plan.traffic import onebit_adam_sent

COMPRESSORS = ("none", "fp16", "int8", "1bit", "1bit-adam", "powersgd")
DATA_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


# ----------------------------------------------------------------------------- 1-bit (signs)

def onebit_compress(x, residual):
    """Signs of v = x + residual, packed 8 per byte, and one scale: (packed, scale, new_residual).

    The scale is the mean absolute value of v, so the decompressed vector (+-scale)
    has the same L1 norm as v. A zero counts as +. new_residual = v - decompressed: what
    this step did not send, added to the next step's x (error feedback). Returns new
    arrays in x's dtype; x and residual are left as they are. (Exercise 10.3.)
    """
    x = np.asarray(x)
    v = x + np.asarray(residual, dtype=x.dtype)
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.mean(np.abs(v)) if v.size else 0)
    new_residual = v - onebit_decompress(packed, scale, v.size)
    return packed, scale, new_residual


def onebit_decompress(packed, scale, n):
    """The n values +scale (bit 1) / -scale (bit 0), in scale's dtype. (Exercise 10.4.)"""
    scale = np.asarray(scale)
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=n)
    return np.where(bits.astype(bool), scale, -scale).astype(scale.dtype)


# ----------------------------------------------------------------------------- 1-bit Adam

def scaled_sign(v):
    """DeepSpeed's 1-bit code of a buffer: (signs packed 8 per byte, scale) with ONE scale,
    ||v||_2 / sqrt(n) (deepspeed/runtime/comm/nccl.py, compressed_allreduce: worker_scale
    and server_scale); a zero counts as +. Decompress with onebit_decompress. (The mean
    |v| of onebit_compress, exercise 10.3, is the scale that minimises the L2 error; the
    root mean square is DeepSpeed's, and what 1-bit Adam here uses.)"""
    v = np.asarray(v)
    scale = v.dtype.type(np.linalg.norm(v) / np.sqrt(v.size) if v.size else 0)
    return np.packbits(v >= 0), scale


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
    dt = np.asarray(x).dtype
    v = np.asarray(x) + worker_error
    bits, s = scaled_sign(v)
    worker_error[...] = v - np.where(v >= 0, s, -s)
    b = chunk_bounds(v.size, N)
    signs = np.unpackbits(bits, count=v.size)
    got = all_to_all_v(comm, [_pack(s, np.packbits(signs[b[j]:b[j + 1]]), dt) for j in range(N)])
    mine, avg = b[me + 1] - b[me], 0
    for msg in got:                                   # every worker's piece of my chunk
        scale, payload = _unpack(msg, dt)
        avg = avg + onebit_decompress(payload, scale, mine)
    avg = avg / N
    c = avg + server_error
    bits, s = scaled_sign(c)
    server_error[...] = c - np.where(c >= 0, s, -s)
    joined = ring_all_gather(comm, _pack(s, bits, dt))
    out, at, k = np.empty(v.size, dt), 0, dt.itemsize
    for j in range(N):
        length = k + -(-(b[j + 1] - b[j]) // 8)
        scale, payload = _unpack(joined[at:at + length], dt)
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
    """

    def __init__(self, inner, dp):
        if dp.compressor != "1bit-adam":
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
        flat = np.concatenate([to_numpy(self.inner.state[id(p)]["exp_avg"]).reshape(-1) if ok
                               else np.zeros(p.data.size, self.dp.dtype)
                               for (_, p), ok in zip(items, live)])
        avg, at = self.dp.allreduce_momentum(flat), 0
        for (g, p), ok in zip(items, live):                 # 3. AdamW's update, v frozen
            at += p.data.size
            if not ok:
                continue
            lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            s = self.inner.state[id(p)]
            m = s["exp_avg"]
            m[...] = xp.asarray(avg[at - m.size:at].reshape(m.shape))
            if wd:
                p.data *= 1.0 - lr * wd
            denom = xp.sqrt(s["exp_avg_sq"]) * (1.0 / math.sqrt(1.0 - b2 ** s["v_step"])) + eps
            p.data -= (lr / (1.0 - b1 ** s["step"])) * (m / denom)


# ----------------------------------------------------------------------------- int8

def int8_compress(x):
    """Symmetric 8-bit codes with one scale: (q, scale), x ~ q * scale.

    scale = max|x| / 127, q = round(x / scale) clipped to [-127, 127]; the error is at most
    scale / 2 per element. An all-zero x has scale 0 and q all zero.
    """
    x = np.asarray(x)
    top = np.max(np.abs(x)) if x.size else 0
    scale = x.dtype.type(top / 127)
    if scale == 0:
        return np.zeros(x.shape, np.int8), scale
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return q, scale


def int8_decompress(q, scale):
    """q * scale, in scale's dtype."""
    scale = np.asarray(scale)
    return np.asarray(q).astype(scale.dtype) * scale


# ----------------------------------------------------------------------------- PowerSGD

def orthogonalize(P):
    """Orthonormal columns spanning P's, by Gram-Schmidt, in a copy (as PowerSGD does).

    Each column loses its components along the columns before it, twice ("twice is
    enough": a second pass removes what the first one's rounding left), then is scaled
    to length 1. A column that is (numerically) zero after that, because P is rank-
    deficient, is set to zero instead of divided by ~0: the product P @ P.T stays the
    projection onto P's column space.
    """
    out = np.array(P, copy=True)
    eps = np.finfo(out.dtype).eps
    for i in range(out.shape[1]):
        col, before = out[:, i], out[:, :i]
        start = np.linalg.norm(col)
        for _ in range(2):
            col -= before @ (before.T @ col)
        norm = np.linalg.norm(col)
        if norm <= 10 * out.shape[0] * eps * start:
            col[:] = 0
        else:
            col /= norm
    return out


def powersgd_step(comm, M, Q):
    """One PowerSGD power iteration on one matrix: (approx, Q_new).

    M: this rank's gradient matrix (n x m, error feedback already added); Q: m x r, the
    same on every rank (the previous step's Q_new). P = M Q summed over ranks,
    orthogonalized; Q_new = M^T P summed over ranks; approx = P Q_new^T / N, the rank-r
    approximation of the average of M. Two ring all-reduces of r(n + m) numbers in all.
    New arrays; M and Q are left as they are. (Exercise 10.5.)
    """
    size = comm.Get_size()
    P = orthogonalize(ring_all_reduce(comm, M @ Q))
    Q_new = ring_all_reduce(comm, M.T @ P)
    return P @ Q_new.T / size, Q_new


# ----------------------------------------------------------------------------- byte formulas

def ring_bytes(n, size, rank, itemsize):
    """Bytes `rank` sends in a ring all-reduce of n items: every chunk but its own in the
    reduce-scatter, every chunk but its right neighbour's in the all-gather."""
    if size == 1:
        return 0
    b = chunk_bounds(n, size)
    length = lambda c: b[c + 1] - b[c]
    return itemsize * (2 * n - length(rank) - length((rank + 1) % size))


# ----------------------------------------------------------------------------- messages

def _pack(scale, payload, dtype):
    """One uint8 message: the scale's bytes (in the gradients' dtype), then the payload's."""
    head = np.asarray([scale], dtype=dtype).view(np.uint8)
    return np.concatenate([head, np.ascontiguousarray(payload).reshape(-1).view(np.uint8)])


def _unpack(msg, dtype):
    """(scale, payload bytes) of a message made by _pack."""
    k = np.dtype(dtype).itemsize
    return msg[:k].copy().view(dtype)[0], msg[k:]


def _payload_bytes(compressor, n):
    """Bytes of n compressed values: one per int8 code, one per 8 signs."""
    return n if compressor == "int8" else -(-n // 8)


# ----------------------------------------------------------------------------- the synchroniser

class CompressedDataParallel:
    """Data parallelism whose gradient average travels compressed (see the module text).

    The same slot as NaiveDataParallel (minidist/train.py's dp): all communication happens
    in sync(), after the last backward. compressor: "none", "fp16", "int8", "1bit",
    "1bit-adam" (with OneBitAdam as the optimizer) or "powersgd". The first `warmup_steps`
    syncs send plain fp32 (1-bit Adam's warm-up); bucket_bytes cuts the flat gradient into
    buckets of that many bytes, each compressed with its own chunks and scales (None: one
    bucket); rank and seed are PowerSGD's rank r and the random seed of its first Q (the same on
    every rank). scales (int8 and 1bit): "tensor", one scale per parameter tensor within
    each chunk, or "chunk", one scale per chunk; None: "tensor" for int8, "chunk" for 1bit
    (what lesson 10 measured best).
    """

    def __init__(self, model, comm, compressor, rank=4, warmup_steps=0, bucket_bytes=None, seed=0,
                 scales=None):
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}, not {compressor!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be 0 or more, not {warmup_steps}")
        if compressor == "1bit-adam" and (warmup_steps < 1 or bucket_bytes is not None):
            raise ValueError("1bit-adam needs warmup_steps >= 1 (its variance is frozen after them) "
                             f"and no bucket_bytes, not {warmup_steps} and {bucket_bytes!r}")
        if bucket_bytes is not None and (compressor == "powersgd" or bucket_bytes <= 0):
            raise ValueError("bucket_bytes must be a positive number of bytes, and powersgd takes none "
                             f"(it batches all matrices into one all-reduce), not {bucket_bytes!r}")
        if scales is None:
            scales = "chunk" if compressor == "1bit" else "tensor"
        if scales not in ("tensor", "chunk"):
            raise ValueError(f"scales must be 'tensor' (one scale per parameter tensor within each chunk) "
                             f"or 'chunk' (one per chunk), not {scales!r}")
        self.model, self.comm, self.compressor, self.scales = model, comm, compressor, scales
        self.rank, self.warmup_steps, self.seed = rank, warmup_steps, seed
        named = (list(model.named_parameters()) if hasattr(model, "named_parameters")
                 else [(f"p{i}", p) for i, p in enumerate(model.parameters())])
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.dtype = np.dtype(self.params[0].data.dtype)
        self.size, self.me = comm.Get_size(), comm.Get_rank()
        self.n = sum(int(p.data.size) for p in self.params)
        self.steps, self.last_sent = 0, 0
        self.buckets = [(0, self.n)]
        if bucket_bytes is not None:
            step = max(1, bucket_bytes // self.dtype.itemsize)
            self.buckets = [(lo, min(lo + step, self.n)) for lo in range(0, self.n, step)]
        # where each parameter starts in the flat vector; each bucket's chunks, cut into segments
        self.starts = np.cumsum([0] + [int(p.data.size) for p in self.params])
        self.layout = [self._layout(lo, hi) for lo, hi in self.buckets]
        # error feedback of 1-bit: this worker's residual of the whole flat vector, and
        # as the server of chunk `me` of every bucket, that chunk's residual
        onebit = compressor in ("1bit", "1bit-adam")
        self.worker_error = np.zeros(self.n if onebit else 0, self.dtype)
        self.server_error = [np.zeros(self._own_chunk(lo, hi) if onebit else 0, self.dtype)
                             for lo, hi in self.buckets]
        self.compressing = False       # 1bit-adam: this step's momentum goes compressed
        if compressor == "powersgd":
            self._setup_powersgd(rank, seed)

    def _own_chunk(self, lo, hi):
        b = chunk_bounds(hi - lo, self.size)
        return b[self.me + 1] - b[self.me]

    def _layout(self, lo, hi):
        """Bucket [lo, hi)'s chunks as (bounds, segments): bounds from chunk_bounds (relative
        to lo), segments[j] the (start, end) pairs of chunk j, relative to the chunk's start,
        each with its own scale: chunk j cut at the parameter boundaries inside it ("tensor"),
        or chunk j whole ("chunk")."""
        bounds = chunk_bounds(hi - lo, self.size)
        segments = []
        for j in range(self.size):
            a, b = lo + bounds[j], lo + bounds[j + 1]
            if self.scales == "chunk":
                segments.append([(0, b - a)])
                continue
            cuts = [a] + [int(c) for c in self.starts if a < c < b] + [b]
            segments.append([(s - a, e - a) for s, e in zip(cuts[:-1], cuts[1:]) if e > s])
        return bounds, segments

    def _message_bytes(self, segments):
        """Bytes of one chunk's message: a scale and a payload per segment."""
        k = self.dtype.itemsize
        return sum(k + _payload_bytes(self.compressor, e - s) for s, e in segments)

    def _setup_powersgd(self, rank, seed):
        """Matrices (ndim >= 2, seen as shape[0] x rest) get rank min(rank, n, m), a Q drawn
        from `seed` (the same on every rank) and a zero error; vectors go uncompressed."""
        shapes = [(p.data.shape[0], p.data.size // p.data.shape[0]) for p in self.params]
        self.matrices = [i for i, p in enumerate(self.params) if p.data.ndim >= 2]
        self.vectors = [i for i, p in enumerate(self.params) if p.data.ndim < 2]
        if self.matrices:
            largest = max(self.matrices, key=lambda i: min(shapes[i]))
            allowed = min(shapes[largest])
            if not 1 <= rank <= allowed:
                raise ValueError(f"powersgd rank must be 1..{allowed}: the largest allowed rank is "
                                 f"{allowed}, min(n, m) of the largest matrix ({self.names[largest]}, "
                                 f"{shapes[largest][0]} x {shapes[largest][1]}), not {rank}")
        rng = np.random.default_rng(seed)
        self.shapes = {i: shapes[i] for i in self.matrices}
        self.ranks = {i: min(rank, *shapes[i]) for i in self.matrices}
        self.Q = {i: rng.standard_normal((shapes[i][1], self.ranks[i])).astype(self.dtype)
                  for i in self.matrices}
        self.error = {i: np.zeros(shapes[i], self.dtype) for i in self.matrices}

    # -- the dp slot
    def __call__(self, *args, **kw):
        return self.model(*args, **kw)

    @contextlib.contextmanager
    def backward_context(self, last):
        """Wrap one micro-batch's backward: nothing to do, all communication is in sync()."""
        yield

    def no_sync(self):
        return self.backward_context(last=False)

    def warming_up(self):
        """Whether the next sync() sends uncompressed fp32 (one of the first warmup_steps)."""
        return self.steps < self.warmup_steps

    def sync(self):
        """Average the gradients over ranks, compressed; p.grad becomes the (decompressed) average."""
        grads = [np.zeros(p.data.shape, self.dtype) if p.grad is None else to_numpy(p.grad)
                 for p in self.params]
        self.compressing = self.compressor == "1bit-adam" and not self.warming_up()
        with stats.measure() as m:
            if self.compressing:       # 1-bit Adam: each worker keeps its own gradient
                out = grads
            elif self.compressor == "powersgd" and not self.warming_up():
                out = self._powersgd(grads)
            else:
                flat = np.concatenate([g.reshape(-1) for g in grads]).astype(self.dtype, copy=False)
                done = np.concatenate([self._bucket(flat[lo:hi], b) for b, (lo, hi) in enumerate(self.buckets)])
                offsets = np.cumsum([0] + [g.size for g in grads])
                out = [done[a:b].reshape(g.shape) for a, b, g in zip(offsets[:-1], offsets[1:], grads)]
        self.last_sent = sum(m.bytes_sent(name) for name in DATA_COLLECTIVES)
        for p, g in zip(self.params, out):
            p.grad = xp.asarray(g.copy())
        self.steps += 1

    def allreduce_momentum(self, flat):
        """1-bit Adam (OneBitAdam.step): the average over ranks of the flat momentum,
        compressed with this slot's worker and server residuals (one rank: flat itself)."""
        if self.size == 1:
            return flat
        return compressed_allreduce(self.comm, flat.astype(self.dtype, copy=False), self.worker_error,
                                    self.server_error[0])

    # -- the flat compressors, one bucket at a time
    def _bucket(self, x, b):
        """The average over ranks of bucket b (x: this rank's piece of the flat gradient)."""
        if self.compressor == "none" or self.warming_up():
            return ring_all_reduce(self.comm, x) / self.size
        if self.compressor == "fp16":      # divide first: no partial sum exceeds the largest |gradient|
            half = (x / self.size).astype(np.float16)
            return ring_all_reduce(self.comm, half).astype(self.dtype)
        return self._two_phase(x, b)

    def _compress(self, x, segments, error=None):
        """One message for chunk x: segment by segment (segments: (start, end) in x), the
        int8 codes, or the 1-bit signs with that segment's slice of `error` (a residual as
        long as x, updated in place: error feedback), each after its scale."""
        parts = []
        for s, e in segments:
            if self.compressor == "int8":
                q, scale = int8_compress(x[s:e])
                parts.append(_pack(scale, np.asarray(q, np.int8), self.dtype))
            else:
                packed, scale, error[s:e] = onebit_compress(x[s:e], error[s:e])
                parts.append(_pack(scale, packed, self.dtype))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8)

    def _decompress(self, msg, segments, n):
        """Chunk x back (n values) from a message made by _compress with these segments."""
        out, at = np.empty(n, self.dtype), 0
        k = self.dtype.itemsize
        for s, e in segments:
            length = k + _payload_bytes(self.compressor, e - s)
            scale, payload = _unpack(msg[at:at + length], self.dtype)
            if self.compressor == "int8":
                out[s:e] = int8_decompress(payload.view(np.int8), scale)
            else:
                out[s:e] = onebit_decompress(payload, scale, e - s)
            at += length
        return out

    def _two_phase(self, x, b):
        """1-bit Adam's scheme: compressed reduce-scatter (all_to_all_v), then a compressed
        all-gather (ring_all_gather) of the averaged chunks, compressed again; every chunk
        one message, one scale per segment."""
        N, me, lo = self.size, self.me, self.buckets[b][0]
        bounds, segments = self.layout[b]
        onebit = self.compressor == "1bit"
        # phase 1: chunk j, compressed segment by segment, goes to rank j
        got = all_to_all_v(self.comm, [
            self._compress(x[bounds[j]:bounds[j + 1]], segments[j],
                           self.worker_error[lo + bounds[j]:lo + bounds[j + 1]] if onebit else None)
            for j in range(N)])
        mine = bounds[me + 1] - bounds[me]
        avg = sum(self._decompress(msg, segments[me], mine) for msg in got) / N
        # phase 2: my averaged chunk, compressed again (1-bit: with the server's error feedback)
        msg = self._compress(avg, segments[me], self.server_error[b] if onebit else None)
        joined = ring_all_gather(self.comm, msg)
        pieces, at = [], 0
        for j in range(N):
            length = self._message_bytes(segments[j])
            pieces.append(self._decompress(joined[at:at + length], segments[j], bounds[j + 1] - bounds[j]))
            at += length
        return np.concatenate(pieces).astype(self.dtype, copy=False)

    # -- PowerSGD
    def _powersgd(self, grads):
        """One power iteration for every matrix at once: all P's in one ring all-reduce,
        all Q's in another; the vectors in a third, uncompressed."""
        N, out = self.size, list(grads)
        M = {i: grads[i].reshape(self.shapes[i]) + self.error[i] for i in self.matrices}
        if self.matrices:
            P = self._all_reduce_parts({i: M[i] @ self.Q[i] for i in self.matrices})
            P = {i: orthogonalize(P[i]) for i in self.matrices}
            self.Q = self._all_reduce_parts({i: M[i].T @ P[i] for i in self.matrices})
            for i in self.matrices:
                approx = P[i] @ self.Q[i].T / N
                self.error[i] = M[i] - approx     # what this rank put in and the average lacks
                out[i] = approx.reshape(grads[i].shape)
                self.Q[i] = self._redraw_zero_columns(i, self.Q[i])
        if self.vectors:
            avg = self._all_reduce_parts({i: grads[i] for i in self.vectors})
            for i in self.vectors:
                out[i] = avg[i] / N
        return out

    def _redraw_zero_columns(self, i, Q):
        """A column of P that orthogonalize() zeroed (this step's summed M had rank < r: a
        matrix fed by a layer norm's output, whose rows sum to zero, does at the start)
        makes a zero column of Q, and the warm start would keep it zero for good (a full-rank
        run would stop being exact): draw it again, from (seed, step, matrix), the same on
        every rank, as the first Q was."""
        dead = np.flatnonzero(~np.any(Q, axis=0))
        if dead.size == 0:
            return Q
        Q = Q.copy()
        fresh = np.random.default_rng([self.seed, self.steps, i]).standard_normal(Q.shape)
        Q[:, dead] = fresh[:, dead]
        return Q

    def _all_reduce_parts(self, parts):
        """Sum {key: array} over ranks as one flat ring all-reduce; the same keys and shapes back."""
        flat = ring_all_reduce(self.comm, np.concatenate([a.reshape(-1) for a in parts.values()]))
        out, at = {}, 0
        for key, a in parts.items():
            out[key] = flat[at:at + a.size].reshape(a.shape)
            at += a.size
        return out

    # -- bytes, from the formulas
    def uncompressed_bytes(self):
        """Bytes this rank sends in one fp32 (the gradients' dtype) ring all-reduce of the gradient."""
        k = self.dtype.itemsize
        return sum(ring_bytes(hi - lo, self.size, self.me, k) for lo, hi in self.buckets)

    def compressed_bytes(self):
        """Bytes this rank sends in one sync() after the warm-up."""
        N, me, k = self.size, self.me, self.dtype.itemsize
        if self.compressor == "none":
            return self.uncompressed_bytes()
        if self.compressor == "fp16":
            return sum(ring_bytes(hi - lo, N, me, 2) for lo, hi in self.buckets)
        if self.compressor == "1bit-adam":
            return onebit_adam_sent(self.n, N, me, k)
        if self.compressor == "powersgd":
            p = sum(self.shapes[i][0] * self.ranks[i] for i in self.matrices)
            q = sum(self.shapes[i][1] * self.ranks[i] for i in self.matrices)
            v = sum(self.params[i].data.size for i in self.vectors)
            return sum(ring_bytes(c, N, me, k) for c in (p, q, v))
        total = 0
        for _, segments in self.layout:
            msg = [self._message_bytes(segments[j]) for j in range(N)]
            # phase 1 sends every chunk but my own; the ring all-gather every chunk but my right neighbour's
            total += sum(msg) - msg[me] + (sum(msg) - msg[(me + 1) % N] if N > 1 else 0)
        return total

    def bytes_formula(self):
        """Bytes this rank sends in the next sync(): uncompressed while warming up."""
        return self.uncompressed_bytes() if self.warming_up() else self.compressed_bytes()

    def run_formula(self, steps):
        """Bytes this rank sends over `steps` syncs from the start, the warm-up included.
        Over a long run with warm-up fraction w, 1 bit sends 1/(w + (1-w)/32) times less than fp32."""
        w = min(steps, self.warmup_steps)
        return w * self.uncompressed_bytes() + (steps - w) * self.compressed_bytes()

    # -- checkpoints
    def state_dict(self):
        """{name: array}: the step counter, the error-feedback residuals, PowerSGD's Q's."""
        d = {"steps": np.array(self.steps)}
        if self.compressor in ("1bit", "1bit-adam"):
            d["onebit.worker_error"] = self.worker_error.copy()
            d["onebit.server_error"] = np.concatenate(self.server_error)
        if self.compressor == "powersgd":
            for i in self.matrices:
                d[f"powersgd.Q.{self.names[i]}"] = self.Q[i].copy()
                d[f"powersgd.error.{self.names[i]}"] = self.error[i].copy()
        return d

    def load_state_dict(self, d):
        """Resume from state_dict()'s arrays (the same model, world size and compressor)."""
        mine = self.state_dict()
        if set(d) != set(mine) or any(np.shape(d[k]) != mine[k].shape for k in mine):
            raise ValueError(f"load_state_dict: expected arrays {sorted((k, v.shape) for k, v in mine.items())}, "
                             f"got {sorted((k, np.shape(v)) for k, v in d.items())}")
        self.steps = int(d["steps"])
        if self.compressor in ("1bit", "1bit-adam"):
            self.worker_error = np.array(d["onebit.worker_error"], self.dtype)
            cuts = np.cumsum([len(e) for e in self.server_error])[:-1]
            self.server_error = np.split(np.array(d["onebit.server_error"], self.dtype), cuts)
        if self.compressor == "powersgd":
            for i in self.matrices:
                self.Q[i] = np.array(d[f"powersgd.Q.{self.names[i]}"], self.dtype)
                self.error[i] = np.array(d[f"powersgd.error.{self.names[i]}"], self.dtype)
