"""Exercise 04's checks pass the package's own answers and catch wrong ones, on every rank."""
import numpy as np
import pytest

from minidist.grader.checks import ex04_pipeline_parallel as ex04
from minidist.parallel import pipeline_parallel

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex04.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_a_received_array_from_the_wrong_rank_fails(comm):
    if comm.Get_size() < 2:
        pytest.skip("needs a partner")

    def own(c, send=None, recv=None):
        got, req = pipeline_parallel.exchange(c, send, recv)
        return (np.zeros_like(got) if got is not None and got.dtype == np.float32 else got), req
    with pytest.raises(AssertionError, match="not the \\(2, 3, 4\\) array rank"):   # every rank, in the float32 ring
        ex04.check_exchange(own)


def test_gpipe_in_reverse_backward_order_passes_but_a_missing_backward_fails(comm):
    def gpipe_rev(p, m):
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))] for _ in range(p)]
    ex04.check_gpipe(gpipe_rev)

    def short(p, m):
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m - 1)] for _ in range(p)]
    with pytest.raises(AssertionError, match="never runs B0"):
        ex04.check_gpipe(short)
