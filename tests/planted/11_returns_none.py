"""copy_overlap that copies right but returns nothing."""

EXPECT = {'11.2': 'copy_overlap returned None'}
RANKS = 2


def copy_overlap(out, out_box, piece, piece_box):
    lo = [max(a, c) for (a, _), (c, _) in zip(out_box, piece_box)]
    hi = [min(b, d) for (_, b), (_, d) in zip(out_box, piece_box)]
    if any(l >= h for l, h in zip(lo, hi)):
        return
    dst = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, out_box))
    src = tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, piece_box))
    out[dst] = piece[src]
