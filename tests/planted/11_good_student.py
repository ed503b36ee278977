"""A right answer to both, written as a student would: the grader must PASS it, the
checkpoint round trips with each function plugged into the package included."""
from minidist.comm import chunk_bounds

EXPECT = {"11.1": None, "11.2": None}
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
            index[ax] = slice(b * mine, b * mine + hi - lo)
            out.append((box, tuple(index)))
    return out


def copy_overlap(out, out_box, piece, piece_box):
    lo = [max(a, c) for (a, _), (c, _) in zip(out_box, piece_box)]
    hi = [min(b, d) for (_, b), (_, d) in zip(out_box, piece_box)]
    if any(l >= h for l, h in zip(lo, hi)):
        return False
    dst = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, out_box))
    src = tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, piece_box))
    out[dst] = piece[src]
    return True
