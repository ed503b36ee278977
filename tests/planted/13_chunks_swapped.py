"""rank_chunks with the two layouts swapped: the contiguous chunks when load balancing is
asked for, the zigzag when it is not."""

EXPECT = {"13.2": "that is the naive layout"}
TIMEOUT = 3


def rank_chunks(rank, cp, load_balance=True):
    if load_balance:
        return [2 * rank, 2 * rank + 1]
    return [rank, 2 * cp - 1 - rank]
