"""Exercise 09's checks pass the package's own answers and catch wrong ones, on every rank.

Called directly (no grader, no rule about 3 ranks); each wrong answer here is wrong on
every rank alike. The grader's view, with planted files: tests/test_planted.py.
"""
import numpy as np
import pytest

from minidist.comm import p2p
from minidist.grader.checks import ex09_moe as ex09

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex09.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_rows_received_from_the_wrong_rank_fail(comm):
    """The rows of rank r-k filed under rank r+k: right at 2 ranks, wrong from 3."""
    n = comm.Get_size()

    def swapped(c, chunks):
        got = p2p.all_to_all_v(c, chunks)
        m = c.Get_size()
        return [got[(2 * c.Get_rank() - i) % m] for i in range(m)]
    if n < 3:
        pytest.skip("below 3 ranks, rank + k and rank - k are the same rank")
    with pytest.raises(AssertionError, match="from rank"):
        ex09.check_all_to_all_v(swapped)


def test_a_widened_dtype_fails(comm):
    def widened(c, chunks):
        return [a.astype(np.float64) for a in p2p.all_to_all_v(c, chunks)]
    with pytest.raises(AssertionError, match="got dtype float64, sent float32"):
        ex09.check_all_to_all_v(widened)


def test_changing_the_inputs_fails(comm):
    def in_place(c, chunks):
        out = p2p.all_to_all_v(c, chunks)
        for a in chunks:
            a[...] = 0
        return out
    with pytest.raises(AssertionError, match="changed send_chunks"):
        ex09.check_all_to_all_v(in_place)
