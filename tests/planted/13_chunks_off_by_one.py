"""rank_chunks whose partner chunk is 2cp - r, one past: chunk 2cp does not exist, and
chunk 2cp-1 belongs to no rank."""

EXPECT = {"13.2": "off by one"}
TIMEOUT = 3


def rank_chunks(rank, cp, load_balance=True):
    if load_balance:
        return [rank, 2 * cp - rank]
    return [2 * rank, 2 * rank + 1]
