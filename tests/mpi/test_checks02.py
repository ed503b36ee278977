"""Exercise 02's checks pass the package's own answers and catch wrong ones, on every rank.

Called directly (no grader, no rule about 3 ranks); each wrong answer here is wrong on
every rank alike. The grader's view, with bugs on one rank: tests/test_planted.py.
"""
import numpy as np
import pytest

from minidist.comm import ring_all_reduce
from minidist.grader.checks import ex02_data_parallel as ex02
from minidist.parallel import data_parallel

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex02.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_the_sum_without_dividing_fails(comm):
    def summed(c, grads):
        return [g * c.Get_size() for g in data_parallel.average_gradients(c, grads)]
    if comm.Get_size() == 1:
        pytest.skip("on one rank the sum is the mean")
    with pytest.raises(AssertionError, match="divide by N"):
        ex02.check_average_gradients(summed)


def test_the_world_size_written_into_the_code_fails(comm):
    """Right on the whole world, wrong on the groups of N-1 ranks and 1 the check adds."""
    n = comm.Get_size()

    def fixed(c, grads):
        return [ring_all_reduce(c, g, op="sum") / n for g in grads]
    if n == 1:
        pytest.skip("one rank: every group has the world's size")
    with pytest.raises(AssertionError, match="not by a number written in the code"):
        ex02.check_average_gradients(fixed)


def test_mpis_own_allreduce_is_refused(comm):
    def mpi(c, grads):
        out = [np.empty_like(g) for g in grads]
        for g, o in zip(grads, out):
            c.Allreduce(g, o)
        return [o / c.Get_size() for o in out]
    with pytest.raises(AssertionError, match="called comm.Allreduce: use ring_all_reduce"):
        ex02.check_average_gradients(mpi)


def test_dividing_the_inputs_in_place_fails(comm):
    def in_place(c, grads):
        for g in grads:
            g /= c.Get_size()
        return data_parallel.average_gradients(c, grads)
    if comm.Get_size() == 1:
        pytest.skip("on one rank g / 1 leaves g as it was")
    with pytest.raises(AssertionError, match="input gradient 0 was changed"):
        ex02.check_average_gradients(in_place)


def test_buckets_in_forward_order_fail(comm):
    def forward_order(nbytes, cap):
        return [[len(nbytes) - 1 - i for i in b] for b in data_parallel.assign_buckets(nbytes[::-1], cap)]
    with pytest.raises(AssertionError, match="expected"):
        ex02.check_assign_buckets(forward_order)


def test_a_float64_mean_of_float32_gradients_fails(comm):
    def widened(c, grads):
        return data_parallel.average_gradients(c, [g.astype(np.float64) for g in grads])
    with pytest.raises(AssertionError, match="is float64, the gradients are float32: keep their dtype"):
        ex02.check_average_gradients(widened)


def test_buffers_kept_between_calls_fail(comm):
    buffers = {}

    def kept(c, grads):
        out = []
        for g in data_parallel.average_gradients(c, grads):
            buf = buffers.setdefault((g.shape, g.dtype.str), np.empty_like(g))
            buf[...] = g
            out.append(buf)
        return out
    with pytest.raises(AssertionError, match="changed when it was called again with other gradients"):
        ex02.check_average_gradients(kept)

    one = []

    def one_list(nbytes, cap):
        one[:] = data_parallel.assign_buckets(nbytes, cap)
        return one
    with pytest.raises(AssertionError, match="changed when it was called again"):
        ex02.check_assign_buckets(one_list)


def test_no_frame_holds_the_mean_while_average_gradients_runs(comm):
    import sys
    found = []

    def peek(c, grads):
        out = data_parallel.average_gradients(c, grads)
        frame = sys._getframe(1)
        while frame is not None:
            for name, value in frame.f_locals.items():
                same = lambda xs, ys: all(isinstance(v, np.ndarray) and v.shape == o.shape and  # noqa: E731
                                          np.allclose(v, o) for v, o in zip(xs, ys))
                if isinstance(value, list) and len(value) == len(out) and same(value, out) and (
                        not same(value, grads)) and any(v.size > 1 for v in value):   # grads' copy: no news
                    found.append(f"{frame.f_code.co_name}: {name}")
            frame = frame.f_back
        return out
    ex02.check_average_gradients(peek)
    assert not found, found


def test_no_frame_holds_the_buckets_while_assign_buckets_runs(comm):
    import sys
    found = []

    def peek(nbytes, cap):
        out = data_parallel.assign_buckets(nbytes, cap)
        frame = sys._getframe(1)
        while frame is not None:
            found.extend(f"{frame.f_code.co_name}: {k}" for k, v in frame.f_locals.items()
                         if v == out and len(out) > 1 and v is not out)
            frame = frame.f_back
        return out
    ex02.check_assign_buckets(peek)
    assert not found, found
