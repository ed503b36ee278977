"""Exercise 01's checks pass the package's own answers and catch wrong ones on every rank.

The checks are called directly here (no grader, so no rule about 3 ranks): at 1, 2, 3, 4
and 8 ranks the package's answers must pass. Every wrong answer below is wrong on every
rank alike, so each rank raises by itself; bugs wrong on one rank only, and deadlocks, are
graded through the grader under mpirun (tests/test_planted.py).
"""
import numpy as np
import pytest

from minidist.comm import collectives
from minidist.grader.checks import ex01_collectives as ex01
from minidist.grader.counting import Session

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex01.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_the_counting_comm_counts_the_rings_bytes_exactly(comm):
    n = comm.Get_size()
    s = Session()
    try:
        x = np.arange(12 * n, dtype=np.float64)
        c = s.counting(ex01.REFUSE)
        collectives.ring_all_reduce(c, x)
        assert c.bytes_sent == 2 * (n - 1) * x.nbytes // n
        assert c.messages_sent == 2 * (n - 1) and c.check_bytes == 128 * (n - 1)
        c = s.counting(ex01.REFUSE)
        collectives.ring_reduce_scatter(c, x, check=False)
        assert c.bytes_sent == (n - 1) * x.nbytes // n and c.check_bytes == 0
    finally:
        s.free()


def test_a_collective_is_refused_in_words(comm):
    def mpi_allreduce(c, x, op="sum"):
        out = np.empty_like(x)
        c.Allreduce(np.ascontiguousarray(x), out)
        return out
    with pytest.raises(AssertionError, match="called comm.Allreduce: use Send/Recv/Sendrecv: this exercise"):
        ex01.check_ring_all_reduce(mpi_allreduce)


def test_pickling_methods_are_refused(comm):
    def pickled(c, x, axis=0):
        c.sendrecv(x, dest=(c.Get_rank() + 1) % c.Get_size())
    with pytest.raises(AssertionError, match="pickles Python objects: use the upper-case"):
        ex01.check_ring_all_gather(pickled)


def test_the_neighbours_chunk_fails_in_words(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has only one chunk")

    def wrong_chunk(c, x, op="sum", axis=0):
        full = collectives.ring_all_reduce(c, x, op=op)
        return np.array_split(full, c.Get_size(), axis=axis)[(c.Get_rank() + 1) % c.Get_size()]
    with pytest.raises(AssertionError, match=r"rank \d+ got for chunk \d+"):
        ex01.check_ring_reduce_scatter(wrong_chunk)


def test_an_all_reduce_in_place_of_a_reduce_scatter_sends_too_much(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing either way")

    def too_much(c, x, op="sum", axis=0):      # right values, twice the bytes
        full = collectives.ring_all_reduce(c, x, op=op, check=False)
        return np.array_split(full, c.Get_size(), axis=axis)[c.Get_rank()]
    with pytest.raises(AssertionError, match="one ring step too many"):
        ex01.check_ring_reduce_scatter(too_much)


def test_no_messages_at_all_fails(comm):
    if comm.Get_size() == 1:
        pytest.skip("on one rank nothing needs sending")

    def alone(c, x, op="sum"):
        return np.array(x, copy=True)
    with pytest.raises(AssertionError, match="got for x of shape"):
        ex01.check_ring_all_reduce(alone)


def test_sum_instead_of_avg_fails(comm):
    if comm.Get_size() == 1:
        pytest.skip("on one rank the sum is the mean")

    def no_divide(c, x, op="sum"):
        return collectives.ring_all_reduce(c, x, op="sum" if op == "avg" else op)
    with pytest.raises(AssertionError, match="op 'avg'"):
        ex01.check_ring_all_reduce(no_divide)


def test_changing_the_input_fails(comm):
    def in_place(c, x, axis=0):
        out = collectives.ring_all_gather(c, x, axis=axis)
        x[...] = 0
        return out
    with pytest.raises(AssertionError, match="changed its input"):
        ex01.check_ring_all_gather(in_place)


def _kept_buffer(fn):
    """The right answer, copied into one buffer per shape and dtype kept between calls."""
    buffers = {}

    def wrong(c, x, *args, **kwargs):
        out = fn(c, x, *args, **kwargs)
        buf = buffers.setdefault((out.shape, out.dtype.str), np.empty_like(out))
        buf[...] = out
        return buf
    return wrong


def test_a_result_kept_in_a_buffer_between_calls_fails(comm):
    """(The all-gather's check is the quickest; the three share the Kept referee, and
    tests/planted/01_reused_buffer.py is ring_reduce_scatter's case.)"""
    with pytest.raises(AssertionError, match="changed when it was called again"):
        ex01.check_ring_all_gather(_kept_buffer(collectives.ring_all_gather))


class Enough(AssertionError):
    """Raised by every rank at the same call: the test has seen what it came for (an
    AssertionError, which world_then_groups passes on as it is)."""


@pytest.mark.parametrize("exercise", ex01.EXERCISES, ids=lambda e: e.name)
def test_no_frame_holds_the_answer_or_the_other_ranks_inputs(comm, exercise):
    """While the student's function runs, the check's frames hold this rank's input only:
    no array of another rank's input, none of the expected result (the first 12 calls,
    several ops on one shape among them)."""
    import sys
    found, calls = [], [0]

    def peek(c, x, *args, **kwargs):
        calls[0] += 1
        if calls[0] > 12:
            raise Enough
        out = exercise.reference(c, x, *args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None:
            for name, value in frame.f_locals.items():
                if isinstance(value, np.ndarray) and value.size > 1 and value.shape == out.shape and (
                        np.array_equal(value, out) and not np.array_equal(value, x)):    # x's copy: no news
                    found.append(f"{frame.f_code.co_name}: {name}")
                if isinstance(value, list) and len(value) == c.Get_size() > 1 and all(
                        isinstance(v, np.ndarray) for v in value):
                    found.append(f"{frame.f_code.co_name}: {name} (every rank's arrays)")
            frame = frame.f_back
        return out
    with pytest.raises(Enough):
        exercise.check(peek)
    assert not found, found
