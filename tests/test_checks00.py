"""The lesson-00 checks pass the package's own answers and catch wrong ones."""
import pytest

from minidist.grader.checks.ex00_autograd import EXERCISES


def _doubled(fn):
    def wrong(*args):
        out = fn(*args)
        return tuple(g * 2 for g in out) if isinstance(out, tuple) else out * 2
    return wrong


def _transposed(fn):
    def wrong(*args):
        out = fn(*args)
        return tuple(g.T for g in out) if isinstance(out, tuple) else out.T
    return wrong


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_check_passes_the_package_answer(ex):
    ex.check(ex.reference)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_check_catches_a_doubled_gradient(ex):
    with pytest.raises(AssertionError, match="expected"):
        ex.check(_doubled(ex.reference))


def _zeroes_its_input(fn, which):
    def wrong(*args):
        out = fn(*args)
        args[which][...] = 0          # x *= 0, or writing into probs: after the right answer
        return out
    return wrong


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
@pytest.mark.parametrize("which", [0, 1])
def test_check_catches_an_input_changed_in_place(ex, which):
    with pytest.raises(AssertionError, match="changed its input `\\w+` in place"):
        ex.check(_zeroes_its_input(ex.reference, which))


def test_writing_into_probs_fails():
    from minidist.fused import softmax_cross_entropy_backward as ref

    def into_probs(probs, targets, grad):
        probs[range(len(targets)), targets] -= 1          # the classic: reuse probs as the output
        probs *= grad / len(targets)
        return probs
    ex = next(e for e in EXERCISES if e.name == "softmax_cross_entropy_backward")
    ex.check(ref)
    with pytest.raises(AssertionError, match="changed its input `probs` in place"):
        ex.check(into_probs)


def test_check_names_a_wrong_shape():
    ex = EXERCISES[0]
    with pytest.raises(AssertionError, match=r"grad_a .* has shape \(4, 3\), expected \(3, 4\)"):
        ex.check(_transposed(ex.reference))


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_stub_raises_not_implemented(ex):
    import importlib.util
    spec = importlib.util.spec_from_file_location("stub00", "lessons/exercises/00_autograd.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(NotImplementedError, match=f"exercise {ex.number}: {ex.name}"):
        ex.check(getattr(mod, ex.name))
