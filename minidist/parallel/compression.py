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

(exact formulas, with numpy.array_split's uneven chunks and the scales, in plan/traffic.py:
ring_bytes, two_phase_sent, onebit_adam_sent, powersgd_sent; `bytes_formula` calls them.)

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
default), or one per chunk (scales="chunk", 1 bit's default: measured below). The flat
vector is the parameters end to end, so a chunk spans many tensors whose gradients differ
in size by orders (the embeddings', the layer norms', the attention weights'); one scale for all of them quantizes the small ones to almost nothing (int8)
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
- Vogels et al. 2019, "PowerSGD": minidist/parallel/powersgd.py.

The warm-up (`warmup_steps` uncompressed syncs) applies to every compressor; with
`bucket_bytes` the flat compressors work bucket by bucket, each with its own chunks
and scales, and its own pair of collectives (PowerSGD takes none: it batches all
matrices into one all-reduce).

Where each idea lives: the compressors' table and their pure codes (int8, 1 bit, the
message format) in minidist/parallel/compressors.py; PowerSGD in powersgd.py; 1-bit Adam
(OneBitAdam, compressed_allreduce) in onebit_adam.py; here the exchanges (a ring for the
summable codes, the two-phase scheme for the others) and the strategy. The exercises'
functions stay importable from this module. Data moves only through minidist.comm's
hand-written collectives.

On a device (MINIDIST_DEVICE=cuda, or the strict double) this project's design keeps the
gradients, the residuals and the coding on the device: sync() flattens and codes there,
and only the messages cross to the host, when the comm layer stages them for MPI (or
none, with a CUDA-aware MPI). So a compressor shrinks the host<->device bytes with the
network bytes: the warm-up's fp32 all-reduce stages 4n bytes out and 4n back per step,
the two-phase 1 bit (3 + 1/N) x n/8 and the scales (every chunk out and in, then this
rank's chunk out and all of them in).
"""
import numpy as np

from minidist.backend import on_device, to_device, to_numpy, xp
from minidist.comm import all_to_all_v, chunk_bounds, ring_all_gather, ring_all_reduce, stats
from minidist.parallel.compressors import (COMPRESSORS, TABLE, int8_compress,  # noqa: F401
                                           int8_decompress, onebit_compress, onebit_decompress, pack,
                                           unpack)
from minidist.parallel.onebit_adam import OneBitAdam, compressed_allreduce, scaled_sign  # noqa: F401
from minidist.parallel.powersgd import LowRank, orthogonalize, powersgd_step  # noqa: F401
from minidist.parallel.strategy import Strategy
from minidist.plan.traffic import (compressed_run_sent, message_bytes, onebit_adam_sent,
                                   ring_bytes, two_phase_sent)

DATA_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


class CompressedDataParallel(Strategy):
    """Data parallelism whose gradient average travels compressed (see the module text).

    A data-parallel strategy (minidist/parallel/strategy.py; train_step's dp slot): all
    communication happens in sync(), after the last backward. compressor: a name of
    compressors.TABLE: "none", "fp16", "int8", "1bit", "1bit-adam" (with OneBitAdam as the
    optimizer) or "powersgd". The first `warmup_steps` syncs send plain fp32 (1-bit Adam's
    warm-up); bucket_bytes cuts the flat gradient into buckets of that many bytes, each
    compressed with its own chunks and scales (None: one bucket); rank and seed are
    PowerSGD's rank r and the random seed of its first Q (the same on every rank). scales
    (int8 and 1bit): "tensor", one scale per parameter tensor within each chunk, or
    "chunk", one scale per chunk; None: the table's default, "tensor" for int8, "chunk"
    for 1bit (what lesson 10 measured best).
    """

    def __init__(self, model, comm, compressor, rank=4, warmup_steps=0, bucket_bytes=None, seed=0,
                 scales=None):
        if compressor not in TABLE:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}, not {compressor!r}")
        code = TABLE[compressor]
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be 0 or more, not {warmup_steps}")
        if code.needs_warmup and (warmup_steps < 1 or bucket_bytes is not None):
            raise ValueError(f"{compressor} needs warmup_steps >= 1 (its variance is frozen after them) "
                             f"and no bucket_bytes, not {warmup_steps} and {bucket_bytes!r}")
        if bucket_bytes is not None and (not code.bucketed or bucket_bytes <= 0):
            raise ValueError("bucket_bytes must be a positive number of bytes, and powersgd takes none "
                             f"(it batches all matrices into one all-reduce), not {bucket_bytes!r}")
        scales = code.scales if scales is None else scales
        if scales not in ("tensor", "chunk"):
            raise ValueError(f"scales must be 'tensor' (one scale per parameter tensor within each chunk) "
                             f"or 'chunk' (one per chunk), not {scales!r}")
        self.model, self.comm, self.compressor, self.scales = model, comm, compressor, scales
        self.code = code
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
        fb = code.error_feedback
        self.worker_error = xp.zeros(self.n if fb else 0, self.dtype)
        self.server_error = [xp.zeros(self._own_chunk(lo, hi) if fb else 0, self.dtype)
                             for lo, hi in self.buckets]
        self.compressing = False       # 1bit-adam: this step's momentum goes compressed
        self.powersgd = (LowRank(self.params, self.names, self.dtype, rank, seed)
                         if code.exchange == "low_rank" else None)
        # after the warm-up, sync() averages the gradients with the row's exchange
        self._exchanges = {"ring": self._flat_ring, "two_phase": self._flat_two_phase,
                           "momentum": self._keep_local, "low_rank": self._low_rank}
        self._sent = {"ring": self._ring_sent, "two_phase": self._two_phase_sent,
                      "momentum": self._momentum_sent, "low_rank": self._low_rank_sent}

    @property
    def ranks(self):
        """PowerSGD: {parameter index: its rank r}."""
        return self.powersgd.ranks if self.powersgd else {}

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
        return message_bytes([e - s for s, e in segments], self.dtype.itemsize, self.code.bits)

    # -- the strategy's hooks
    def __call__(self, *args, **kw):
        return self.model(*args, **kw)

    def warming_up(self):
        """Whether the next sync() sends uncompressed fp32 (one of the first warmup_steps)."""
        return self.steps < self.warmup_steps

    def sync(self):
        """Average the gradients over ranks, compressed; p.grad becomes the (decompressed) average."""
        grads = [xp.zeros(p.data.shape, self.dtype) if p.grad is None else xp.asarray(p.grad)
                 for p in self.params]
        exchange = self._flat_fp32 if self.warming_up() else self._exchanges[self.code.exchange]
        self.compressing = exchange == self._keep_local      # 1-bit Adam past its warm-up
        with stats.measure() as m:
            out = exchange(grads)
        self.last_sent = sum(m.bytes_sent(name) for name in DATA_COLLECTIVES)
        for p, g in zip(self.params, out):
            p.grad = g.copy()
        self.steps += 1

    def allreduce_momentum(self, flat):
        """1-bit Adam (OneBitAdam.step): the average over ranks of the flat momentum,
        compressed with this slot's worker and server residuals (one rank: flat itself)."""
        if self.size == 1:
            return flat
        return compressed_allreduce(self.comm, flat.astype(self.dtype, copy=False), self.worker_error,
                                    self.server_error[0])

    # -- the exchanges: each takes the gradients, returns their average
    def _flat(self, grads, bucket):
        """The gradients end to end, averaged bucket by bucket with bucket(x, b), cut back."""
        flat = xp.concatenate([g.reshape(-1) for g in grads]).astype(self.dtype, copy=False)
        done = xp.concatenate([bucket(flat[lo:hi], b) for b, (lo, hi) in enumerate(self.buckets)])
        offsets = np.cumsum([0] + [g.size for g in grads])
        return [done[a:b].reshape(g.shape) for a, b, g in zip(offsets[:-1], offsets[1:], grads)]

    def _flat_fp32(self, grads):
        """The warm-up (and "none"): a ring all-reduce of the gradients, divided by N."""
        return self._flat(grads, lambda x, b: ring_all_reduce(self.comm, x) / self.size)

    def _flat_ring(self, grads):
        """A summable code (fp16): the sum of float16 numbers is a float16 number, so the
        ring adds them hop by hop; divide first: no partial sum exceeds the largest |gradient|."""
        wire = self.code.wire
        if wire is None:
            return self._flat_fp32(grads)
        return self._flat(grads, lambda x, b: ring_all_reduce(
            self.comm, (x / self.size).astype(wire)).astype(self.dtype))

    def _flat_two_phase(self, grads):
        return self._flat(grads, self._two_phase)

    def _keep_local(self, grads):
        """1-bit Adam: each worker keeps its own gradient; OneBitAdam averages the momentum."""
        return grads

    def _low_rank(self, grads):
        return self.powersgd.average(self.comm, grads, self.steps)

    def _compress(self, x, segments, error=None):
        """One message for chunk x: segment by segment (segments: (start, end) in x), the
        row's code of that segment (with its slice of `error`, a residual as long as x,
        updated in place, when the code has error feedback), each after its scale."""
        parts = []
        for s, e in segments:
            scale, payload, residual = self.code.encode(x[s:e], None if error is None else error[s:e])
            if error is not None:
                error[s:e] = residual
            parts.append(pack(scale, payload, self.dtype))
        return xp.concatenate(parts) if parts else xp.zeros(0, np.uint8)

    def _decompress(self, msg, segments, n):
        """Chunk x back (n values) from a message made by _compress with these segments."""
        out, at = xp.empty(n, self.dtype), 0
        for s, e in segments:
            length = self._message_bytes([(s, e)])
            scale, payload = unpack(msg[at:at + length], self.dtype)
            out[s:e] = self.code.decode(payload, scale, e - s)
            at += length
        return out

    def _two_phase(self, x, b):
        """1-bit Adam's scheme: compressed reduce-scatter (all_to_all_v), then a compressed
        all-gather (ring_all_gather) of the averaged chunks, compressed again; every chunk
        one message, one scale per segment."""
        N, me, lo = self.size, self.me, self.buckets[b][0]
        bounds, segments = self.layout[b]
        fb = self.code.error_feedback
        # phase 1: chunk j, compressed segment by segment, goes to rank j
        got = all_to_all_v(self.comm, [
            self._compress(x[bounds[j]:bounds[j + 1]], segments[j],
                           self.worker_error[lo + bounds[j]:lo + bounds[j + 1]] if fb else None)
            for j in range(N)])
        mine = bounds[me + 1] - bounds[me]
        avg = sum(self._decompress(msg, segments[me], mine) for msg in got) / N
        # phase 2: my averaged chunk, compressed again (1-bit: with the server's error feedback)
        msg = self._compress(avg, segments[me], self.server_error[b] if fb else None)
        joined = ring_all_gather(self.comm, msg)
        pieces, at = [], 0
        for j in range(N):
            length = self._message_bytes(segments[j])
            pieces.append(self._decompress(joined[at:at + length], segments[j], bounds[j + 1] - bounds[j]))
            at += length
        return xp.concatenate(pieces).astype(self.dtype, copy=False)

    # -- bytes, from plan/traffic.py's formulas
    def uncompressed_bytes(self):
        """Bytes this rank sends in one fp32 (the gradients' dtype) ring all-reduce of the gradient."""
        k = self.dtype.itemsize
        return sum(ring_bytes(hi - lo, self.size, self.me, k) for lo, hi in self.buckets)

    def _ring_sent(self):
        k = np.dtype(self.code.wire or self.dtype).itemsize
        return sum(ring_bytes(hi - lo, self.size, self.me, k) for lo, hi in self.buckets)

    def _two_phase_sent(self):
        return sum(two_phase_sent([self._message_bytes(seg) for seg in segments], self.me)
                   for _, segments in self.layout)

    def _momentum_sent(self):
        return onebit_adam_sent(self.n, self.size, self.me, self.dtype.itemsize)

    def _low_rank_sent(self):
        return self.powersgd.sent(self.size, self.me)

    def compressed_bytes(self):
        """Bytes this rank sends in one sync() after the warm-up."""
        return self._sent[self.code.exchange]()

    def bytes_formula(self):
        """Bytes this rank sends in the next sync(): uncompressed while warming up."""
        return self.uncompressed_bytes() if self.warming_up() else self.compressed_bytes()

    def run_formula(self, steps):
        """Bytes this rank sends over `steps` syncs from the start, the warm-up included
        (plan.traffic.compressed_run_sent)."""
        return compressed_run_sent(steps, self.warmup_steps, self.uncompressed_bytes(),
                                   self.compressed_bytes())

    # -- checkpoints
    def state_dict(self):
        """{name: host array}: the step counter, the error-feedback residuals, PowerSGD's
        Q's (a device's arrays brought home, counted: a checkpoint is host data)."""
        d = {"steps": np.array(self.steps)}
        if self.code.error_feedback:
            d["onebit.worker_error"] = np.array(to_numpy(self.worker_error))
            d["onebit.server_error"] = to_numpy(xp.concatenate(self.server_error))
        if self.powersgd:
            d.update(self.powersgd.state_dict())
        return d

    def load_state_dict(self, d):
        """Resume from state_dict()'s arrays (the same model, world size and compressor)."""
        mine = self.state_dict()
        shape = lambda a: tuple(a.shape) if on_device(a) else np.shape(a)     # noqa: E731
        if set(d) != set(mine) or any(shape(d[k]) != mine[k].shape for k in mine):
            want = sorted((k, v.shape) for k, v in mine.items())
            raise ValueError(f"load_state_dict: expected arrays {want}, "
                             f"got {sorted((k, shape(v)) for k, v in d.items())}")
        self.steps = int(d["steps"])
        if self.code.error_feedback:
            self.worker_error = to_device(np.array(to_numpy(d["onebit.worker_error"]), self.dtype))
            cuts = [int(c) for c in np.cumsum([len(e) for e in self.server_error])[:-1]]
            server = to_device(np.array(to_numpy(d["onebit.server_error"]), self.dtype))
            self.server_error = xp.split(server, cuts)
        if self.powersgd:
            self.powersgd.load_state_dict(d)
