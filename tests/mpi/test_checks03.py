"""Exercise 03's checks pass the package's own answers and catch wrong ones, on every rank.

Called directly (no grader, so no rule about 3 ranks): at 1, 2, 3, 4 and 8 ranks the
package's answers must pass. Each wrong answer here is wrong on every rank alike (or the
test says where it is not); the grader's view of the bugs students write is
tests/test_planted.py.
"""
import numpy as np
import pytest

from minidist.comm import all_reduce, ring_all_gather
from minidist.grader.checks import ex03_tensor_parallel as ex03
from minidist.parallel import tensor_parallel as tp

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex03.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def _many(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank: a sum over ranks is the identity")


def test_an_all_reduce_too_many_fails_on_values_and_bytes(comm):
    _many(comm)
    with pytest.raises(AssertionError, match="the sum over ranks: g's backward is the identity"):
        ex03.check_g_backward(lambda c, grad: all_reduce(c, grad))
    with pytest.raises(AssertionError, match="this rank's part only"):
        ex03.check_f_backward(lambda c, grad: grad)


def test_mpis_own_allreduce_is_refused(comm):
    def mpi(c, x):
        out = np.empty_like(x)
        c.Allreduce(x, out)
        return out
    with pytest.raises(AssertionError, match="called comm.Allreduce: use all_reduce"):
        ex03.check_g_forward(mpi)


def test_no_max_overflows(comm):
    """Without the shift by the max, exp(1000) is inf: the loss is nan."""
    def no_max(c, logits, targets, lo, vocab_size):
        n, v = logits.shape
        pad = (lo + np.arange(v)) >= vocab_size
        e = np.where(pad, 0.0, np.exp(logits))
        inside = (targets >= lo) & (targets < lo + v)
        mine = np.where(inside, logits[np.arange(n), np.where(inside, targets - lo, 0)], 0.0)
        all_reduce(c, np.zeros(n), op="max")                       # the bytes of three all-reduces
        target, s = all_reduce(c, mine), all_reduce(c, e.sum(axis=1))
        return (np.log(s) - target).mean(), e / s[:, None]
    with np.errstate(all="ignore"), pytest.raises(AssertionError, match="the loss of the vocab-parallel loss"):
        ex03.check_vocab_parallel_cross_entropy_forward(no_max)


def test_gathering_the_logits_fails_the_bytes(comm):
    """The right values from the whole logits gathered: b*s*v bytes instead of 3 b*s."""
    _many(comm)

    def gathered(c, logits, targets, lo, vocab_size):
        whole = ring_all_gather(c, logits, axis=1)[:, :vocab_size]
        m = whole.max(axis=1, keepdims=True)
        e = np.exp(whole - m)
        s = e.sum(axis=1)
        loss = np.mean(np.log(s) + m[:, 0] - whole[np.arange(len(targets)), targets])
        probs = np.zeros_like(logits)
        hi = min(lo + logits.shape[1], vocab_size)
        probs[:, :max(hi - lo, 0)] = (e / s[:, None])[:, lo:hi]
        return loss, probs
    with pytest.raises(AssertionError, match="the size of the whole logits"):
        ex03.check_vocab_parallel_cross_entropy_forward(gathered)


def test_the_padding_must_count_as_minus_infinity(comm):
    _many(comm)                                                     # one rank: nothing is padded
    def unmasked(c, logits, targets, lo, vocab_size):
        return tp.vocab_parallel_cross_entropy_forward(c, logits, targets, lo, 10**9)
    with pytest.raises(AssertionError, match="vocab-parallel loss"):
        ex03.check_vocab_parallel_cross_entropy_forward(unmasked)


def test_the_wrong_axis_fails(comm):
    with pytest.raises(AssertionError, match="is cut along axis 1"):
        ex03.check_split_for_rank(lambda a, axis, rank, t: tp.split_for_rank(a, 0, rank, t))
