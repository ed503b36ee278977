"""Planted bug: the split assumes the length divides by t (len // t each): with uneven
lengths the pieces are wrong and the last elements belong to nobody."""


def split_for_rank(a, axis, rank, t):
    k = a.shape[axis] // t
    index = [slice(None)] * a.ndim
    index[axis] = slice(rank * k, (rank + 1) * k)
    return a[tuple(index)]
