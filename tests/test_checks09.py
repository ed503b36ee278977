"""Exercise 9.1's check (route, serial): the package's answer passes, the referee agrees
with it on many groups, and each wrong rule fails with words that name it."""
import numpy as np
import pytest

from minidist import moe
from minidist.grader.checks import ex09_moe as ex09


def test_the_package_route_passes():
    ex09.check_route(moe.route)


@pytest.mark.parametrize("seed", range(20))
def test_the_referee_agrees_with_the_package(seed):
    g = np.random.default_rng(seed)
    T, E, k = int(g.integers(1, 30)), int(g.integers(2, 9)), int(g.integers(1, 3))
    probs = g.integers(0, 4, size=(T, E)) / 8.0                 # many ties
    cap = None if seed % 3 == 0 else int(g.integers(1, T + 1))
    want, got = ex09.referee_route(probs, min(k, E), cap), moe.route(probs, min(k, E), cap)
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])


def _variant(change):
    def route(probs, top_k, capacity):
        experts, keep = moe.route(probs, top_k, capacity)
        return change(probs, top_k, capacity, experts, keep)
    return route


@pytest.mark.parametrize("change, words", [
    (lambda p, k, c, e, keep: (e, np.ones_like(keep)), "should be dropped"),             # capacity ignored
    (lambda p, k, c, e, keep: (e, keep.astype(np.int8)), "keep must be a bool array"),
    (lambda p, k, c, e, keep: (e.astype(np.float64), keep), "experts must be integers"),
    (lambda p, k, c, e, keep: (e[:, ::-1].copy(), keep[:, ::-1].copy()), "highest first"),
    (lambda p, k, c, e, keep: [e, keep], "return (experts, keep)"),
])
def test_a_wrong_rule_fails_in_words(change, words):
    with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ex09.check_route(_variant(change))


def test_writing_into_probs_fails():
    def normalising(probs, top_k, capacity):
        probs /= probs.sum(axis=1, keepdims=True)
        return moe.route(probs, top_k, capacity)
    with pytest.raises(AssertionError, match="changed probs"):
        ex09.check_route(normalising)
