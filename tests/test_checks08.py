"""The lesson-08 checks pass the package's own answers (minidist/recompute.py) and catch wrong ones."""
import pytest

from minidist import recompute
from minidist.grader.checks.ex08_activation_recompute import EXERCISES
from minidist.tensor import Tensor


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_check_passes_the_package_answer(ex):
    ex.check(ex.reference)


def test_the_package_calls_the_functions_the_exercise_names():
    assert {e.name for e in EXERCISES} <= set(vars(recompute))
    assert all(getattr(recompute, e.name) is e.reference for e in EXERCISES)


def test_a_forward_that_records_the_graph_fails():
    def keeps(fn, inputs):
        return fn(*inputs), recompute.dropout_counters(inputs)
    with pytest.raises(AssertionError, match="keeps .* bytes of activations"):
        EXERCISES[0].check(keeps)


def test_a_rerun_with_new_masks_fails():
    def no_rewind(fn, inputs, counters, grad):
        now = [(rng, rng.calls) for rng, _ in counters]
        leaves = [Tensor(x.data, requires_grad=x.requires_grad) if isinstance(x, Tensor) else x for x in inputs]
        out = fn(*leaves)
        for rng, calls in now:
            rng.calls = calls
        out.backward(grad)
        return [x.grad if isinstance(x, Tensor) else None for x in leaves]
    with pytest.raises(AssertionError, match="differs from the run without recomputation"):
        EXERCISES[1].check(no_rewind)
