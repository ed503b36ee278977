"""tp_regions with one box for the whole cut axis: c_attn's q | k | v blocks ignored."""
from minidist.comm import chunk_bounds

EXPECT = {'11.1': 'one box per block'}
RANKS = 2


def tp_regions(full_shape, spec, rank, t):
    if spec is None:
        return [([[0, n] for n in full_shape], tuple(slice(None) for _ in full_shape))]
    ax = spec.axis
    real = full_shape[ax] if spec.size is None else spec.size
    cut = chunk_bounds(spec.padded or full_shape[ax], t)
    lo, hi = cut[rank], min(cut[rank + 1], real)
    if hi <= lo:
        return []
    box = [[0, n] for n in full_shape]
    box[ax] = [lo, hi]
    index = [slice(None)] * len(full_shape)
    index[ax] = slice(0, hi - lo)
    return [(box, tuple(index))]
