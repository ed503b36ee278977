"""route keeps one choice more than the capacity (`order[capacity + 1:]` dropped): right
whenever no expert is full, wrong by one token per full expert."""
import numpy as np

EXPECT = {"9.1": "an off-by-one?"}
RANKS = 1


def route(probs, top_k, capacity):
    T, E = probs.shape
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(np.int64)
    keep = np.ones((T, top_k), dtype=bool)
    if capacity is not None:
        for e in range(E):
            tok, slot = np.nonzero(experts == e)
            order = np.lexsort((tok, -probs[tok, e]))
            keep[tok[order[capacity + 1:]], slot[order[capacity + 1:]]] = False
    return experts, keep
