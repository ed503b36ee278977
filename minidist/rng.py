"""Dropout masks that depend on the sample, not on the process that holds it.

A data-parallel run splits a global batch across ranks. If each rank drew its masks
from its own stream, rank 1's sample 5 would get a different mask from the one the
single-process run gave it, and the two runs could never match. Here row i of every
mask comes from a generator seeded by (seed, step, sample_ids[i], k), k counting this
object's mask calls (the k-th dropout layer of the forward), so the masks follow the
sample's index in the global batch wherever it is computed.

    from minidist.rng import DropoutRNG
    rng = DropoutRNG(seed=0, step=3, sample_ids=[4, 5])   # this rank holds samples 4, 5
"""
import numpy

from minidist.backend import xp


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
        out = numpy.empty(tuple(shape), dtype=dtype)
        for row, sid in enumerate(self.sample_ids):
            g = numpy.random.default_rng([self.seed, self.step, sid, k])
            keep = g.random(shape[1:], dtype=numpy.float32) >= p   # float32 draws: same mask in any dtype
            numpy.multiply(keep, 1.0 / (1.0 - p), out=out[row], casting="unsafe")
        return xp.asarray(out)
