"""Exercise 13's serial checks (13.1 merge_partials, 13.2 rank_chunks): the package's answers
pass, the referee agrees with the package, wrong answers fail in words that name the
mistake, the plug-in check (lesson 13 with the function plugged in) catches what the unit
cases alone would not, and the exercise file as shipped grades TODO. 13.3 under mpirun:
tests/mpi/test_checks13.py; the grader's view, with planted files: tests/test_planted.py."""
import re

import numpy as np
import pytest

from minidist import attention
from minidist.grader import command as grade
from minidist.grader.checks import ex13_context_parallel as ex13
from minidist.parallel import context_parallel

STUBS = grade.Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "13_context_parallel.py"


@pytest.mark.parametrize("check, fn", [(ex13.check_merge_partials, attention.merge_partials),
                                       (ex13.check_rank_chunks, context_parallel.rank_chunks)])
def test_the_package_answer_passes(check, fn):
    check(fn)


def test_the_stubs_are_todo():
    rows = grade.Grader(timeout=30, out=lambda *_: None).grade(str(STUBS), "13_context_parallel")
    assert [(r["exercise"], r["verdict"]) for r in rows] == [("13.1", "TODO"), ("13.2", "TODO"), ("13.3", "TODO")]


def test_the_referee_agrees_with_the_package():
    for args, what in ex13._merge_cases():
        want = ex13.referee_merge(*args)
        with np.errstate(all="ignore"):
            got = attention.merge_partials(*args)
        assert np.array_equal(np.isneginf(want[1]), np.isneginf(got[1])), what
        tol = ex13.TOL[args[0].dtype]
        assert np.allclose(got[0], want[0], rtol=tol, atol=tol) and np.allclose(got[1], want[1], rtol=tol), what
    for cp in range(1, 6):
        for rank in range(cp):
            for lb in (True, False):
                assert ex13.referee_chunks(rank, cp, lb) == context_parallel.rank_chunks(rank, cp, lb)


def _merge(change):
    def merge_partials(o1, lse1, o2, lse2):
        o, lse = attention.merge_partials(o1, lse1, o2, lse2)
        return change(o1, lse1, o2, lse2, o, lse)
    return merge_partials


@pytest.mark.parametrize("fn, words", [
    (_merge(lambda o1, l1, o2, l2, o, lse: (o, np.maximum(l1, l2))), "that is max(lse1, lse2)"),
    (_merge(lambda o1, l1, o2, l2, o, lse: (o.astype(np.float32), lse)), "got o float32 and lse float64"),
    (_merge(lambda o1, l1, o2, l2, o, lse: (o, lse[..., None])), "expected (2, 3, 5, 4) and (2, 3, 5)"),
    (_merge(lambda o1, l1, o2, l2, o, lse: [o]), "return (o, lse), two arrays"),
    (_merge(lambda o1, l1, o2, l2, o, lse: (o, l2) if np.isfinite(l2).all() else (o, lse)),
     "shares memory with lse2"),
])
def test_a_wrong_merge_fails_in_words(fn, words):
    with pytest.raises(AssertionError, match=re.escape(words)):
        ex13.check_merge_partials(fn)


_KEPT = {}


def kept_result(o1, lse1, o2, lse2):
    """Returns the same output buffer for every call of one shape: the last result changes."""
    o, lse = attention.merge_partials(o1, lse1, o2, lse2)
    buf = _KEPT.setdefault((o.shape, o.dtype.str), np.empty_like(o))
    buf[...] = o
    return buf, lse


def test_a_result_kept_between_calls_fails():
    with pytest.raises(AssertionError, match="changed when it was called again"):
        ex13.check_merge_partials(kept_result)


@pytest.mark.parametrize("fn, words", [
    (lambda r, cp, load_balance=True: (r, 2 * cp - 1 - r) if load_balance else (2 * r, 2 * r + 1), None),
    (lambda r, cp, load_balance=True: [float(v) for v in context_parallel.rank_chunks(r, cp, load_balance)],
     "return a list of chunk indices, ints"),
    (lambda r, cp, load_balance=False: context_parallel.rank_chunks(r, cp, load_balance),
     "called without load_balance: the default is True"),
    (lambda r, cp, load_balance=True: context_parallel.rank_chunks(r, cp, load_balance)[::-1],
     "returned [1, 0], expected [0, 1] (the right chunks in the wrong order"),
    (lambda r, cp, load_balance=True: [r, 2 * cp - 1 - r] if load_balance else [r, r + 1],
     "returned [1, 2], expected [2, 3]"),
])
def test_rank_chunks_forms_and_rules(fn, words):
    if words is None:             # a tuple of ints is a sequence of chunk indices too
        ex13.check_rank_chunks(fn)
        return
    with pytest.raises(AssertionError, match=re.escape(words)):
        ex13.check_rank_chunks(fn)


def test_only_the_plug_in_check_catches_a_merge_that_differs_in_use(tmp_path):
    """Right when the grader's unit check calls it, 1e-9 off when the package does: the unit
    check alone PASSes it; lesson 13 (one process here, cp = 1: the ring merges its own
    block's parts) with it plugged in does not match to 1e-10."""
    f = tmp_path / "13_context_parallel.py"
    f.write_text("import sys\nfrom minidist.attention import merge_partials as _m\n"
                 "def merge_partials(o1, lse1, o2, lse2):\n"
                 "    o, lse = _m(o1, lse1, o2, lse2)\n"
                 "    caller = sys._getframe(1).f_globals.get('__name__', '')\n"
                 "    return (o if caller.startswith('minidist.grader') else o * (1 + 1e-9)), lse\n")
    unit_only = grade.Grader(timeout=60, out=lambda *_: None, plugins=False)
    assert [r["verdict"] for r in unit_only.grade(str(f), "13_context_parallel", {"13.1"})] == ["PASS"]
    (row,) = grade.Grader(timeout=60, out=lambda *_: None).grade(str(f), "13_context_parallel", {"13.1"})
    assert row["verdict"] == "FAIL" and row["message"].startswith("lesson 13 with your merge_partials"), row
    assert "MISMATCH: max_rel_diff" in row["message"] and "> tolerance 1e-10" in row["message"], row
