"""Exercises 05 and 06's checks pass the package's answers and catch wrong ones, on every rank.

Called directly (no grader); each wrong answer here is wrong on every rank alike. The
grader's view, with students' files: tests/test_planted.py.
"""
import numpy as np
import pytest

from minidist.comm import ring_all_reduce, ring_reduce_scatter
from minidist.grader.checks import ex05_zero as ex05, ex06_fsdp as ex06
from minidist.parallel import zero

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex05.EXERCISES + ex06.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_off_by_one_partition_fails():
    def last_gets_more(n, size, rank):
        q = n // size
        return rank * q, (rank + 1) * q if rank < size - 1 else n
    with pytest.raises(AssertionError, match="numpy.array_split gives the first"):
        ex05.check_partition(last_gets_more)


def test_a_full_all_reduce_fails_the_bytes(comm):
    def all_reduce(c, flat):
        lo, hi = zero.partition(flat.size, c.Get_size(), c.Get_rank())
        return ring_all_reduce(c, flat, op="sum")[lo:hi] / c.Get_size()
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing either way")
    with pytest.raises(AssertionError, match="that is a full all-reduce"):
        ex05.check_reduce_scatter_grad(all_reduce)


@pytest.mark.parametrize("divisor, words", [(lambda n: 1, "divide by N"), (lambda n: n * n, "divided twice")])
def test_averaging_not_at_all_or_twice_fails(comm, divisor, words):
    if comm.Get_size() == 1:
        pytest.skip("at one rank the sum is the mean")
    with pytest.raises(AssertionError, match=words):
        ex05.check_reduce_scatter_grad(lambda c, flat: ring_reduce_scatter(c, flat, op="sum") / divisor(c.Get_size()))


def test_not_freeing_fails(comm):
    with pytest.raises(AssertionError, match="still holds"):
        ex06.check_free_params(lambda group: None)


def test_copies_instead_of_views_fail(comm):
    def copies(c, group):
        full = ex06.fsdp.gather_params(c, group)
        for p in group.params:
            p.data = np.array(p.data)
        return full
    with pytest.raises(AssertionError, match="not a view"):
        ex06.check_gather_params(copies)
