"""Exercise 02's checks pass the package's own answers and catch wrong ones, on every rank."""
import pytest

from minidist.lessons.checks import ex02_data_parallel as ex02
from minidist.parallel import data_parallel

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex02.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(exercise):
    exercise.check(exercise.reference)


def test_the_sum_without_dividing_fails():
    def summed(comm, grads):
        return [g * comm.Get_size() for g in data_parallel.average_gradients(comm, grads)]
    if ex02.MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("on one rank the sum is the mean")
    with pytest.raises(AssertionError, match="divide by N"):
        ex02.check_average_gradients(summed)


def test_buckets_in_forward_order_fail():
    def forward_order(nbytes, cap):
        return [[len(nbytes) - 1 - i for i in b] for b in data_parallel.assign_buckets(nbytes[::-1], cap)]
    with pytest.raises(AssertionError, match="expected"):
        ex02.check_assign_buckets(forward_order)
