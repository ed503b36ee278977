"""copy_overlap that copies the whole piece into out, not only the overlap."""

EXPECT = {'11.2': 'copy only the overlap'}
RANKS = 2


def copy_overlap(out, out_box, piece, piece_box):
    if any(max(a, c) >= min(b, d) for (a, b), (c, d) in zip(out_box, piece_box)):
        return False
    start = tuple(c - a for (a, _), (c, _) in zip(out_box, piece_box))
    out[tuple(slice(s, s + n) for s, n in zip(start, piece.shape))] = piece
    return True
