"""route fills each expert in token order (first come, first served) instead of keeping the
highest probabilities: the counts per expert are right, the tokens kept are not."""
import numpy as np

EXPECT = {"9.1": "you kept them in token order"}
RANKS = 1


def route(probs, top_k, capacity):
    T, E = probs.shape
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(np.int64)
    keep = np.ones((T, top_k), dtype=bool)
    if capacity is not None:
        used = np.zeros(E, np.int64)
        for t in range(T):
            for k in range(top_k):
                e = experts[t, k]
                keep[t, k] = used[e] < capacity
                used[e] += 1
    return experts, keep
