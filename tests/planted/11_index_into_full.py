"""tp_regions whose index is into the global tensor, not into the rank's shard."""
from minidist.comm import chunk_bounds

EXPECT = {'11.1': "the index is into this rank's LOCAL shard"}
RANKS = 2


def tp_regions(full_shape, spec, rank, t):
    if spec is None:
        return [([[0, n] for n in full_shape], tuple(slice(None) for _ in full_shape))]
    ax = spec.axis
    real = full_shape[ax] if spec.size is None else spec.size
    block = (spec.padded or full_shape[ax]) // spec.blocks
    cut = chunk_bounds(block, t)
    mine = cut[rank + 1] - cut[rank]
    out = []
    for b in range(spec.blocks):
        lo = b * block + cut[rank]
        hi = min(lo + mine, real)
        if hi > lo:
            box = [[0, n] for n in full_shape]
            box[ax] = [lo, hi]
            index = [slice(None)] * len(full_shape)
            index[ax] = slice(lo, hi)
            out.append((box, tuple(index)))
    return out
