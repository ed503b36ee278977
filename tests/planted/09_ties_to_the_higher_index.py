"""route sorts the probabilities ascending and reads them backwards: the top k are right,
but a tie goes to the higher expert index, so two ranks that route the same tokens with
two different sorts would disagree."""
import numpy as np

EXPECT = {"9.1": "on a tie the lower expert index first"}
RANKS = 1


def route(probs, top_k, capacity):
    T, E = probs.shape
    experts = np.argsort(probs, axis=1, kind="stable")[:, ::-1][:, :top_k].astype(np.int64)
    keep = np.ones((T, top_k), dtype=bool)
    if capacity is not None:
        for e in range(E):
            tok, slot = np.nonzero(experts == e)
            order = np.lexsort((tok, -probs[tok, e]))
            keep[tok[order[capacity:]], slot[order[capacity:]]] = False
    return experts, keep
