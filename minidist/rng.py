"""Dropout masks that depend on the sample, not on the process that holds it.

A data-parallel run splits a global batch across ranks. If each rank drew its masks
from its own stream, rank 1's sample 5 would get a different mask from the one the
single-process run gave it, and the two runs could never match. Here row i of every
mask comes from a generator seeded by (seed, step, sample_ids[i], k), k counting this
object's mask calls (the k-th dropout layer of the forward), so the masks follow the
sample's index in the global batch wherever it is computed.

    from minidist.rng import DropoutRNG
    rng = DropoutRNG(seed=0, step=3, sample_ids=[4, 5])   # this rank holds samples 4, 5

Blockwise attention never holds a whole (B, nh, T, T) mask, and context parallelism
splits its rows and columns over ranks, so its dropout is a pure function of each
element's names instead (`position_keep_mask`): a counter-based hash of (seed, step,
sample id, call k, head, query position, key position), the same mask whatever tile or
rank computes it. minidist/attention.py's AttentionDropout takes one call k from the
forward's DropoutRNG, as the plain attention's single mask call does.

On a device (MINIDIST_DEVICE=cuda or strict) the two kinds cross differently. A
DropoutRNG's masks are drawn on the host (NumPy's generator, seeded per sample) and cross
to the device as bits, 1/32 of a float32 mask, unpacked and scaled there. The positional
hash runs on the device; only its (seed, step, sample id, k) prefix, one 64-bit number per
sample, is hashed on the host and copied over, once per dropout call.
"""
import math

import numpy

from minidist.backend import on_device, to_device, xp


class DropoutRNG:
    def __init__(self, seed, step, sample_ids):
        self.seed = int(seed)
        self.step = int(step)
        self.sample_ids = [int(i) for i in sample_ids]
        self.calls = 0                     # k: which dropout call of this forward we are at

    def mask(self, shape, p, dtype):
        """The scaled keep mask, 0 or 1/(1-p), of `shape`; shape[0] == len(sample_ids)."""
        if shape[0] != len(self.sample_ids):
            raise ValueError(f"mask shape {tuple(shape)} has {shape[0]} rows, but this DropoutRNG "
                             f"holds {len(self.sample_ids)} sample ids")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), not {p}")
        k, self.calls = self.calls, self.calls + 1
        keep = numpy.empty(tuple(shape), dtype=bool)
        for row, sid in enumerate(self.sample_ids):
            g = numpy.random.default_rng([self.seed, self.step, sid, k])
            keep[row] = g.random(shape[1:], dtype=numpy.float32) >= p   # float32 draws: same mask in any dtype
        # the keep bits cross to the device packed, eight to a byte, and are scaled there:
        # 0 or 1 times 1/(1-p) in float64, then rounded to dtype
        bits = to_device(numpy.packbits(keep, axis=None))
        kept = xp.unpackbits(bits)[:keep.size].reshape(keep.shape)
        return (kept * (1.0 / (1.0 - p))).astype(dtype)

def dropout_rng_of(rng):
    """The DropoutRNG behind a view of it (an object that keeps it as .rng: a SlicedRNG, a
    PositionsRNG), or None for None: the one whose counter `calls` a rerun rewinds."""
    while rng is not None and not hasattr(rng, "calls") and hasattr(rng, "rng"):
        rng = rng.rng
    return rng

# ----------------------------------------------------------------------------- masks from positions

# SplitMix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators",
# OOPSLA; the finalizer as in Vigna's splitmix64.c): the golden-ratio increment and the mix.
_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = 2**64 - 1


def _uint64(values):
    """Integers (negative ones too, as two's complement) as a uint64 array on the device
    (host integers are copied over: a counted transfer on a device)."""
    if on_device(values):
        return values.astype(xp.int64).astype(xp.uint64)
    return to_device(numpy.asarray(values, dtype=numpy.int64)).astype(xp.uint64)


def _mix64(z):
    """SplitMix64's finalizer on a uint64 array (host or device), in place (uint64
    arithmetic wraps mod 2^64)."""
    z ^= z >> numpy.uint64(30)
    z *= numpy.uint64(_MIX1)
    z ^= z >> numpy.uint64(27)
    z *= numpy.uint64(_MIX2)
    z ^= z >> numpy.uint64(31)
    return z


def _fold(h, values):
    """h combined with values (uint64 arrays on the same side, broadcast):
    mix(h + (values + 1) gamma)."""
    z = (values + numpy.uint64(1)) * numpy.uint64(_GAMMA)
    return _mix64(h + z)


def position_key(seed, step, sample_ids, k):
    """The hash of (seed, step, sample id, call k) per sample, (len(sample_ids),) uint64 on
    the device: position_keep_mask's first folds, done on the host (a few numbers) and
    copied over once; AttentionDropout keeps it for every tile of its forward and backward."""
    h = _mix64(numpy.asarray([int(seed) & _MASK64], dtype=numpy.uint64))
    for name in (step, k):
        h = _fold(h, numpy.asarray([int(name) & _MASK64], dtype=numpy.uint64))
    ids = numpy.asarray([int(s) for s in sample_ids], dtype=numpy.int64).astype(numpy.uint64)
    return to_device(_fold(h, ids))                                              # (B,)


def position_keep_mask(seed, step, sample_ids, k, heads, q_pos, k_pos, p, dtype, key=None):
    """The scaled dropout mask, 0 or 1/(1-p), of attention elements named by position.

    Returns (len(sample_ids), len(heads), len(q_pos), len(k_pos)). Element (b, h, i, j)
    keeps iff u >= p, u the top 24 bits of a counter-based hash of (seed, step,
    sample_ids[b], k, heads[h], q_pos[i], k_pos[j]) over 2^24: a pure function of the
    element's global names, so any tiling of the (query, key) grid, any split of the
    sequence or of the heads over ranks, draws the same mask (Salmon et al. 2011's
    counter-based generators, "Parallel random numbers: as easy as 1, 2, 3", make the
    same trade). The hash: SplitMix64 folded over the names one at a time, each
    h <- mix(h + (name + 1) gamma); the last fold, over the key position, is the only
    one done per element, and it is SplitMix64's own stream (state h, counter k_pos + 1).
    u is a multiple of 2^-24, exact in float32 and float64: the mask does not depend on
    dtype. Cost: about ten uint64 operations per element. key: position_key(seed, step,
    sample_ids, k), when the caller keeps it (made here otherwise).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), not {p}")
    h = position_key(seed, step, sample_ids, k) if key is None else key        # (B,)
    h = _fold(h[:, None], _uint64(heads)[None, :])                               # (B, H)
    h = _fold(h[:, :, None], _uint64(q_pos))                                     # (B, H, Tq)
    z = _fold(h[..., None], _uint64(k_pos))                                      # (B, H, Tq, Tk)
    # keep iff (z >> 40) / 2^24 >= p, i.e. iff z >= ceil(p 2^24) 2^40 (p 2^24 is exact)
    c = int(math.ceil(p * 2**24))
    if c >= 2**24:                                       # p within 2^-24 of 1: nothing kept
        return xp.zeros(z.shape, dtype=dtype)
    out = (z >= xp.uint64(c << 40)).astype(dtype)
    out *= 1.0 / (1.0 - p)
    return out
