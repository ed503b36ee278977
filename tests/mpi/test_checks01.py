"""Exercise 01's checks pass the package's own answers and catch wrong ones on every rank."""
import numpy as np
import pytest

from minidist.comm import collectives
from minidist.lessons.checks import ex01_collectives as ex01

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex01.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_the_neighbours_chunk_fails_in_words(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has only one chunk")

    def wrong_chunk(c, x, op="sum", axis=0):
        full = collectives.ring_all_reduce(c, x, op=op)
        return np.array_split(full, c.Get_size(), axis=axis)[(c.Get_rank() + 1) % c.Get_size()]
    with pytest.raises(AssertionError, match=r"rank \d+ got for chunk \d+"):
        ex01.check_ring_reduce_scatter(wrong_chunk)


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
