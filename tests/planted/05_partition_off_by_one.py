"""Planted bug: the remainder goes to the last rank (array_split gives it to the first ranks)."""


def partition(n, size, rank):
    q = n // size
    return rank * q, (rank + 1) * q if rank < size - 1 else n
