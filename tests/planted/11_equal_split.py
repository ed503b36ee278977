"""tp_regions that cuts each block in t equal parts (n // t), not by array_split's rule."""

EXPECT = {'11.1': "numpy.array_split's rule"}
RANKS = 2


def tp_regions(full_shape, spec, rank, t):
    if spec is None:
        return [([[0, n] for n in full_shape], tuple(slice(None) for _ in full_shape))]
    ax = spec.axis
    real = full_shape[ax] if spec.size is None else spec.size
    block = (spec.padded or full_shape[ax]) // spec.blocks
    cut = [min(c * (block // t), block) for c in range(t)] + [block]
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
