"""A right answer to all five, written as a student would: the grader must PASS it, the
training runs with each function plugged into the package included."""
import numpy as np
from minidist.comm import ring_all_reduce  # noqa: F401
from minidist.parallel.compression import orthogonalize  # noqa: F401

EXPECT = {"10.1": None, "10.2": None, "10.3": None, "10.4": None, "10.5": None}
RANKS = 3


def unscale_grads(grads, scale):
    out, found = [], False
    for g in grads:
        if g is None:
            out.append(None)
            continue
        u = np.asarray(g, dtype=np.float32) / np.float32(scale)
        found = found or not np.isfinite(u).all()
        out.append(u)
    return out, bool(found)


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps


def onebit_compress(x, residual):
    v = x + residual
    packed = np.packbits(v >= 0)
    scale = x.dtype.type(np.abs(v).mean())
    return packed, scale, v - np.where(v >= 0, scale, -scale)


def onebit_decompress(packed, scale, n):
    bits = np.unpackbits(packed, count=n).astype(bool)
    return np.where(bits, scale, -scale).astype(np.asarray(scale).dtype)


def powersgd_step(comm, M, Q):
    n = comm.Get_size()
    P = orthogonalize(ring_all_reduce(comm, M @ Q))
    Q_new = ring_all_reduce(comm, M.T @ P)
    return P @ Q_new.T / n, Q_new
