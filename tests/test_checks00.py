"""The lesson-00 checks pass the package's own answers and catch wrong ones."""
import pytest

from minidist.lessons.checks.ex00_autograd import EXERCISES


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
