"""copy_overlap that takes piece's part at offsets relative to out_box."""

EXPECT = {'11.2': "piece's part was taken at offsets relative to out_box"}
RANKS = 2


def copy_overlap(out, out_box, piece, piece_box):
    lo = [max(a, c) for (a, _), (c, _) in zip(out_box, piece_box)]
    hi = [min(b, d) for (_, b), (_, d) in zip(out_box, piece_box)]
    if any(l >= h for l, h in zip(lo, hi)):
        return False
    dst = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, out_box))
    src = dst
    out[dst] = piece[src]
    return True
