"""tp_regions that cuts a replicated tensor (spec None) along axis 0 like a shard."""
from minidist.comm import chunk_bounds

EXPECT = {'11.1': 'spec None is replicated'}
RANKS = 2


def tp_regions(full_shape, spec, rank, t):
    if spec is None:
        if not full_shape:
            return [([], ())]
        cut = chunk_bounds(full_shape[0], t)
        box = [[0, n] for n in full_shape]
        box[0] = [cut[rank], cut[rank + 1]]
        return [(box, (slice(cut[rank], cut[rank + 1]),) + tuple(slice(None) for _ in full_shape[1:]))]
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
            index[ax] = slice(b * mine, b * mine + hi - lo)
            out.append((box, tuple(index)))
    return out
