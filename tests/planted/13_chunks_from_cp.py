"""rank_chunks that pairs chunk r with cp-1-r, as if the sequence were cut into cp chunks
rather than 2cp."""

EXPECT = {"13.2": "cut into 2cp chunks, not cp"}
TIMEOUT = 3


def rank_chunks(rank, cp, load_balance=True):
    if load_balance:
        return [rank, cp - 1 - rank]
    return [2 * rank, 2 * rank + 1]
