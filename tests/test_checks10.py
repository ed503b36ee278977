"""Exercise 10's serial checks: the package's answers pass, each wrong rule fails in words
that name it, and the exercise file as shipped grades TODO. (The grader's view, with
planted files: tests/test_planted.py; 10.5 on several ranks: tests/mpi/test_checks10.py.)"""
import numpy as np
import pytest

from minidist import precision
from minidist.grader import command as grade
from minidist.grader.checks import ex10_precision_and_compression as ex10
from minidist.parallel import compression

STUBS = grade.Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "10_precision_and_compression.py"


@pytest.mark.parametrize("exercise", ex10.EXERCISES, ids=lambda e: e.name)
def test_the_package_answer_passes(exercise):
    exercise.check(exercise.reference)          # 10.5 on one rank here


def test_the_stubs_are_todo():
    rows = grade.Grader(timeout=30, out=lambda *_: None).grade(str(STUBS), "10_precision_and_compression")
    assert [r["verdict"] for r in rows] == ["TODO"] * 5, rows
    assert [r["exercise"] for r in rows] == ["10.1", "10.2", "10.3", "10.4", "10.5"]


def test_the_referees_agree_with_the_package():
    s, good = 2.0 ** 10, 0
    for found in np.random.default_rng(0).random(200) < 0.2:
        want = ex10.referee_update(s, good, bool(found), 2.0, 0.5, 3)
        assert precision.update_scale(s, good, bool(found), 2.0, 0.5, 3) == want
        s, good = want
    P = np.random.default_rng(1).standard_normal((7, 3))
    assert np.allclose(ex10.referee_orthogonalize(P), compression.orthogonalize(P), atol=1e-12)


def unscale_rounding(grads, scale):
    """Right except in float16 arithmetic: rounded to 16 bits before the fp32 result."""
    out, found = precision.unscale_grads(grads, scale)
    return [None if o is None else o.astype(np.float16).astype(np.float32) for o in out], found


def compress_plain_residual(x, residual):
    packed, scale, _ = compression.onebit_compress(x, residual)
    return packed, scale, np.zeros_like(x)


@pytest.mark.parametrize("check, fn, words", [
    (ex10.check_unscale_grads, unscale_rounding, "a power of two divides exactly"),
    (ex10.check_unscale_grads, lambda g, s: (precision.unscale_grads(g, s)[0], 1), "found_inf must be a bool"),
    (ex10.check_unscale_grads, lambda g, s: precision.unscale_grads(g, s)[0], "return (grads, found_inf)"),
    (ex10.check_update_scale, lambda s, g, f, *a: precision.update_scale(s, g, f, *a[:2], 2000),
     "growth_interval"),
    (ex10.check_update_scale, lambda s, g, f, gr=2.0, bo=0.5, gi=2000: precision.update_scale(s, g, f, gr, 0.5, gi),
     "backoff_factor"),
    (ex10.check_onebit_compress, compress_plain_residual, "new_residual is"),
    (ex10.check_onebit_compress, lambda x, r: compression.onebit_compress(x, r)[:2], "return (packed, scale"),
    (ex10.check_onebit_decompress, lambda p, s, n: compression.onebit_decompress(p, s, n + 1), "got shape"),
    (ex10.check_onebit_decompress, lambda p, s, n: compression.onebit_decompress(p, s, n).astype(np.float64),
     "return scale's dtype"),
])
def test_a_wrong_answer_fails_in_words(check, fn, words):
    with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check(fn)


def test_only_the_training_run_catches_a_scaler_that_differs_in_use():
    """update_scale right when the check calls it, wrong when GradScaler does (it never
    grows there): the unit calls pass, the fp16 run finds it."""
    import sys
    ref = precision.update_scale

    def sneaky(scale, good, found, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if sys._getframe(1).f_globals.get("__name__") == "minidist.precision":
            return (scale * backoff_factor, 0) if found else (scale, good + 1)
        return ref(scale, good, found, growth_factor, backoff_factor, growth_interval)
    with pytest.raises(AssertionError, match="fp16 training of a tiny GPT"):
        ex10.check_update_scale(sneaky)


def test_two_answers_that_pass_alone_fail_together():
    """A numpy.bool_ found_inf (10.1) and an update_scale that tests `is True` (10.2): beside
    the package's other half each trains right; plugged in together the scale never backs
    off, and only the plug-in check with both plugged in at once sees it."""
    from mpi4py import MPI
    from minidist.grader import plugin

    unscale, update = precision.unscale_grads, precision.update_scale     # the package's, kept

    def unscale_numpy_bool(grads, scale):
        out, found = unscale(grads, scale)
        return out, np.bool_(found)

    def update_is_true(scale, good, found, growth=2.0, backoff=0.5, interval=2000):
        return update(scale, good, found is True, growth, backoff, interval)

    ex1, ex2 = ex10.EXERCISES[:2]
    assert plugin.shared_runs([ex1, ex2]) == list(ex10.FP16_RUNS)
    session = plugin.PluginSession(MPI.COMM_SELF)
    try:
        with pytest.raises(AssertionError, match="with your unscale_grads and update_scale together .* MISMATCH"):
            plugin.check_together(ex10.FP16_RUNS[0], [ex1, ex2], [unscale_numpy_bool, update_is_true], session)
        plugin.check_together(ex10.FP16_RUNS[0], [ex1, ex2], [ex1.reference, ex2.reference], session)
    finally:
        session.free()
