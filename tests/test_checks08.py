"""The lesson-08 checks pass the package's own answers (minidist/recompute.py) and catch wrong ones."""
import pytest

from minidist import recompute
from minidist.grader.checks.ex08_activation_recompute import EXERCISES, START
from minidist.tensor import Tensor, no_grad


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


def _backward(start_at=None, leaf_grad=True):
    """A checkpoint_backward that rewinds each rng to start_at(saved) for the rerun."""
    def backward(fn, inputs, counters, grad):
        now = [(rng, rng.calls) for rng, _ in counters]
        for rng, saved in counters:
            rng.calls = start_at(saved)
        leaves = [Tensor(x.data, requires_grad=leaf_grad and x.requires_grad) if isinstance(x, Tensor) else x
                  for x in inputs]
        out = fn(*leaves)
        for rng, calls in now:
            rng.calls = calls
        out.backward(grad)
        return [x.grad if isinstance(x, Tensor) else None for x in leaves]
    return backward


def test_a_forward_that_rewinds_the_counter_fails():
    def rewinds(fn, inputs):
        counters = recompute.dropout_counters(inputs)
        with no_grad():
            out = fn(*inputs)
        for rng, c in counters:
            rng.calls = c
        return out, counters
    with pytest.raises(AssertionError, match=f"counter is {START}; fn drew 3 masks from {START}"):
        EXERCISES[0].check(rewinds)


def test_a_forward_whose_counters_are_zero_fails():
    def zero(fn, inputs):
        with no_grad():
            out = fn(*inputs)
        return out, [(rng, 0) for rng, _ in recompute.dropout_counters(inputs)]
    with pytest.raises(AssertionError, match=f"counters should be \\[\\(the DropoutRNG, {START}\\)\\]"):
        EXERCISES[0].check(zero)


def test_a_rerun_from_counter_zero_fails_naming_the_masks():
    with pytest.raises(AssertionError, match="drew dropout masks 0, 1, 2 where its forward drew .*you rewound to 0"):
        EXERCISES[1].check(_backward(lambda saved: 0))
    EXERCISES[1].check(_backward(lambda saved: saved))


def test_an_input_left_without_gradient_is_said_so_not_blamed_on_the_masks():
    with pytest.raises(AssertionError, match="returned None as the gradient of input 0, a Tensor that requires grad"):
        EXERCISES[1].check(_backward(lambda saved: saved, leaf_grad=False))


def test_the_package_functions_are_back_after_a_failing_check():
    with pytest.raises(AssertionError):
        EXERCISES[1].check(_backward(lambda saved: 0))
    assert all(getattr(recompute, e.name) is e.reference for e in EXERCISES)


def test_the_students_own_assert_is_named_as_theirs():
    def asserts(fn, inputs):
        assert len(inputs) == 1, "one input only"
    with pytest.raises(AssertionError, match="your code's assert failed: one input only"):
        EXERCISES[0].check(asserts)
