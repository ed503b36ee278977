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


# ----------------------------------------------------------------------------- 5.1's bounds, 5.2's dtype and buffers

@pytest.mark.parametrize("kind, words", [(float, "not float"), (np.int64, "not numpy.int64"),
                                         (np.float64, "not numpy.float64")])
def test_partition_bounds_that_are_not_python_ints_fail(kind, words):
    def typed(n, size, rank):
        lo, hi = zero.partition(n, size, rank)
        return kind(lo), kind(hi)
    with pytest.raises(AssertionError, match=f"bounds are Python ints, {words}"):
        ex05.check_partition(typed)


def test_no_length_is_divided_by_a_graded_world_or_group_size():
    for n in ex05.LENGTHS[:2]:
        assert all(n % size for size in (2, 3, 4, 5, 7, 8)), n


def test_a_float64_result_of_float32_gradients_fails(comm):
    def widens(c, flat):
        return ring_reduce_scatter(c, flat.astype(np.float64), op="sum") / c.Get_size()
    with pytest.raises(AssertionError, match="the result is float64, the gradient is float32"):   # every rank alike
        ex05.check_reduce_scatter_grad(widens)


def test_a_buffer_kept_between_calls_fails(comm):
    buffers = {}

    def kept(c, flat):
        out = ring_reduce_scatter(c, flat, op="sum") / c.Get_size()
        buf = buffers.setdefault((c.Get_size(), out.shape, out.dtype.str), np.empty_like(out))
        buf[...] = out
        return buf
    with pytest.raises(AssertionError, match="return a new array on every call"):    # at the repeat, every rank
        ex05.check_reduce_scatter_grad(kept)


def test_no_frame_holds_the_partition_while_reduce_scatter_grad_runs(comm):
    import sys
    found = []

    def peek(c, flat):
        out = zero.reduce_scatter_grad(c, flat)
        frame = sys._getframe(1)
        while frame is not None and out.size > 1:
            found.extend(f"{frame.f_code.co_name}: {name}" for name, value in frame.f_locals.items()
                         if isinstance(value, np.ndarray) and value is not out and value.shape == out.shape
                         and np.allclose(value, out) and not np.allclose(value, flat))   # flat's copy: no news
            frame = frame.f_back
        return out
    ex05.check_reduce_scatter_grad(peek)
    assert not found, found


def test_no_frame_holds_the_bounds_while_partition_runs():
    import sys
    found = []

    def peek(n, size, rank):
        out = zero.partition(n, size, rank)
        frame = sys._getframe(1)
        while frame is not None and out[1] > out[0] + 1:
            found.extend(f"{frame.f_code.co_name}: {name}" for name, value in frame.f_locals.items()
                         if value == out or (isinstance(value, list) and out in value))
            frame = frame.f_back
        return out
    ex05.check_partition(peek)
    assert not found, found
