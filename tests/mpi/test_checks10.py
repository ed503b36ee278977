"""Exercise 10.5's check passes the package's powersgd_step and catches wrong ones, on every
rank (called directly: no grader, no rule about 3 ranks). The grader's view, with planted
files: tests/test_planted.py."""
import numpy as np
import pytest

from minidist.comm import ring_all_reduce
from minidist.grader.checks import ex10_precision_and_compression as ex10
from minidist.parallel import compression

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 3
WHY = "at 3 ranks the check itself also runs on groups of 2 ranks and of 1"


def test_the_package_powersgd_step_passes(comm):
    ex10.check_powersgd_step(compression.powersgd_step)


def test_a_float64_result_for_float32_fails(comm):
    def widened(c, M, Q):
        approx, Q_new = compression.powersgd_step(c, M, Q)
        return approx.astype(np.float64), Q_new
    with pytest.raises(AssertionError, match="approx is float64, M is float32"):
        ex10.check_powersgd_step(widened)


def test_summing_M_instead_of_P_fails_on_its_bytes(comm):
    if comm.Get_size() < 2:
        pytest.skip("one rank sends nothing")

    def reduces_m(c, M, Q):
        S = ring_all_reduce(c, M)
        P = compression.orthogonalize(S @ Q)
        Q_new = S.T @ P
        return P @ Q_new.T / c.Get_size(), Q_new
    with pytest.raises(AssertionError, match="a ring all-reduce of M itself"):
        ex10.check_powersgd_step(reduces_m)
