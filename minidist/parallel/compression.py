"""Gradient compression for data parallelism: send fewer bytes per step, keep what was
not sent for later (error feedback), and still converge.

    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression

Plain data parallelism sends 2(N-1)/N x (gradient bytes) per rank per step (a ring
all-reduce of fp32 gradients). The compressors here send less:

    compressor   what travels                                  bytes per rank, n gradients
    none         the fp32 gradients                            2(N-1)/N x 4n
    fp16         the gradients / N, cast to float16            2(N-1)/N x 2n
    int8         int8 codes + one scale per chunk              ~2(N-1)/N x n
    1bit         signs packed 8 per byte + one scale per chunk ~2(N-1)/N x n/8
    powersgd     two thin matrices P (n x r), Q (m x r)         2(N-1)/N x 4r(n+m) per n x m matrix

(exact formulas, with numpy.array_split's uneven chunks and the scales: `bytes_formula`.)

fp16: the sum of float16 numbers is a float16 number, so the ring all-reduce (a
reduce-scatter that adds hop by hop, then an all-gather) works unchanged. Each rank
divides by N *before* the cast, so the running sum never exceeds the largest gradient
seen and cannot overflow float16's 65504 where the fp32 average would not.

int8 and 1bit: the sum of two int8 codes (with their own scales) or of two sign vectors
is neither, so a ring cannot add them hop by hop. 1-bit Adam's two-phase scheme instead:

    phase 1 (a reduce-scatter of compressed pieces): cut the flat gradient into N chunks
      (minidist.comm.chunk_bounds), compress each chunk with its own scale, send chunk j
      to rank j (all_to_all_v); rank j decompresses the N pieces of chunk j it holds and
      averages them. Sends (N-1)/N x (compressed bytes).
    phase 2 (an all-gather of compressed chunks): rank j compresses its averaged chunk
      again and ring_all_gather brings every rank all N compressed chunks, which every
      rank decompresses. Sends (N-1)/N x (compressed bytes) again.

Together 2(N-1)/N x (compressed size): 1/4 of fp32 for int8, 1/32 for 1 bit (plus the
scales). The obvious alternative, an all-gather of every rank's whole compressed
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
  fp32 ring all-reduce), then compressed with the two-phase scheme above, with error
  feedback on both sides: each worker keeps a residual of its whole vector (phase 1),
  each rank as the "server" of its chunk keeps a residual of that chunk (phase 2).
- Vogels et al. 2019, "PowerSGD": a gradient matrix M (n x m) is approximated by
  P Q^T of rank r: P = M Q, all-reduced, orthogonalized; Q = M^T P, all-reduced;
  one power iteration per step, with Q reused from the previous step (a warm start
  that makes one iteration enough). Every rank's M includes its error feedback, and its
  new error is M minus the averaged approximation (the rule of the paper's reference
  code and of PyTorch's powerSGD hook). The P's of all matrices travel in one
  all-reduce, the Q's in another; vectors (biases, layer-norm weights) are small and
  go uncompressed, in one more all-reduce, as the paper and PyTorch's hook do.

The pure functions (onebit_compress, int8_compress, orthogonalize, powersgd_step, ...)
are exercises; CompressedDataParallel calls them through this module's globals, so a
student's version plugged in as `compression.onebit_compress = mine` is the one used.
Data moves only through minidist.comm's hand-written collectives.
"""
import contextlib

import numpy as np

from minidist.backend import to_numpy, xp
from minidist.comm import all_to_all_v, chunk_bounds, ring_all_gather, ring_all_reduce, stats

COMPRESSORS = ("none", "fp16", "int8", "1bit", "powersgd")
DATA_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


# ----------------------------------------------------------------------------- 1-bit (signs)

def onebit_compress(x, residual):
    """Signs of v = x + residual, packed 8 per byte, and one scale: (packed, scale, new_residual).

    The scale is the mean absolute value of v, so the decompressed vector (+-scale)
    has the same L1 norm as v. A zero counts as +. new_residual = v - decompressed: what
    this step did not send, added to the next step's x (error feedback). Returns new
    arrays in x's dtype; x and residual are left as they are. (Exercise 10.x.)
    """
    x = np.asarray(x)
    v = x + np.asarray(residual, dtype=x.dtype)
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.mean(np.abs(v)) if v.size else 0)
    new_residual = v - onebit_decompress(packed, scale, v.size)
    return packed, scale, new_residual


def onebit_decompress(packed, scale, n):
    """The n values +scale (bit 1) / -scale (bit 0), in scale's dtype."""
    scale = np.asarray(scale)
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=n)
    return np.where(bits.astype(bool), scale, -scale).astype(scale.dtype)


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
    New arrays; M and Q are left as they are.
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
