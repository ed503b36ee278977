"""The lesson-00 checks pass the package's own answers and catch wrong ones."""
import numpy as np
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


def _widened(fn):
    def wrong(*args):
        out = fn(*[a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a
                   for a in args])
        return out                    # right values, computed (and returned) in float64
    return wrong


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_a_float64_result_for_float32_inputs_fails(ex):
    with pytest.raises(AssertionError, match="is float64, expected float32: keep the inputs' dtype"):
        ex.check(_widened(ex.reference))


def _kept_buffer(fn):
    """The right answer, written into buffers kept per shape and dtype between calls."""
    buffers = {}

    def wrong(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        kept = []
        for i, o in enumerate(outs):
            buf = buffers.setdefault((i, o.shape, o.dtype), np.empty_like(o))
            buf[...] = o
            kept.append(buf)
        return tuple(kept) if isinstance(out, tuple) else kept[0]
    return wrong


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_a_buffer_kept_between_calls_fails(ex):
    with pytest.raises(AssertionError, match="changed when it was called again"):
        ex.check(_kept_buffer(ex.reference))


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_no_frame_holds_the_answer_while_the_function_runs(ex):
    """The check computes the expected gradients only after the call returned: while the
    student's function runs, no local of any frame above it holds them."""
    import sys
    found = []

    def peek(*args):
        out = ex.reference(*args)
        answers = [np.asarray(o) for o in (out if isinstance(out, tuple) else (out,))]
        frame = sys._getframe(1)
        while frame is not None:
            for name, value in frame.f_locals.items():
                if isinstance(value, np.ndarray) and any(      # (by hand: a test may have replaced np.allclose)
                        value.shape == a.shape and a.size > 1 and (np.abs(value - a) <= 1e-4 * np.abs(a)).all()
                        for a in answers):
                    found.append(f"{frame.f_code.co_name}: {name}")
            frame = frame.f_back
        return out
    ex.check(peek)
    assert not found, found


def test_lesson_00_reaches_every_function_and_catches_a_wrong_one():
    """The plug-in check: each function is called by lesson 00's run, and a gradient off by 1%
    in the engine only (the unit check's calls are right) makes lesson 00 MISMATCH."""
    from mpi4py import MPI
    from minidist.grader import plugin
    session = plugin.PluginSession(MPI.COMM_SELF)
    try:
        for ex in EXERCISES:
            plugin.check(ex, ex.reference, session)       # raises "never called" when not reached
        calls = [0]

        def late_wrong(a, b, grad):
            calls[0] += 1
            ga, gb = EXERCISES[0].reference(a, b, grad)
            return ga, gb * 1.01
        with pytest.raises(AssertionError, match="lesson 00 with your matmul_backward .* MISMATCH"):
            plugin.check(EXERCISES[0], late_wrong, session)
        assert calls[0] > 10
    finally:
        session.free()
