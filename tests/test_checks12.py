"""Exercise 12's checks: the package's answers pass, wrong ones fail in words that name the
mistake, the referees agree with the package, the plug-in run (the function in the package
while lesson 12 runs) catches what the unit cases cannot, and the exercise file as shipped
grades TODO. (The grader's view, with planted files: tests/test_planted.py.)"""
import sys
from fractions import Fraction

import numpy as np
import pytest

from minidist.grader import command as grade
from minidist.grader.checks import ex12_plan as ex12
from minidist.plan import choose as choosing
from minidist.plan import memory, pipeline

STUBS = grade.Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "12_plan.py"


@pytest.mark.parametrize("exercise", ex12.EXERCISES, ids=lambda e: e.name)
def test_the_package_answer_passes(exercise):
    exercise.check(exercise.reference)


def test_the_stubs_are_todo():
    rows = grade.Grader(timeout=30, out=lambda *_: None).grade(str(STUBS), "12_plan")
    assert [r["verdict"] for r in rows] == ["TODO"] * 4, rows
    assert [r["exercise"] for r in rows] == ["12.1", "12.2", "12.3", "12.4"]


def test_the_referees_agree_with_the_package():
    for psi in (7.5e9, 70e9, 12345):
        for n_d in (1, 3, 64):
            for stage in range(4):
                for acc in ("zero", "megatron", "fp32", (1, 2, 3)):
                    want = ex12.referee_states(psi, n_d, stage, acc)
                    got = memory.model_state_bytes(psi, n_d, stage, acc)
                    assert all(abs(Fraction(got[k]) - want[k]) <= 1e-15 * want[k] for k in want)
    for name, p, m, v, costs in ex12._bubble_cases():
        assert pipeline.bubble_fraction(name, p, m, v, costs) == ex12.referee_bubble(name, p, m, v, costs)
    for p, m, v in ex12._flight_cases():
        assert pipeline.in_flight(p, m, v) == ex12.referee_in_flight(p, m, v)


def numpy_states(psi, n_d, stage, accounting="zero"):
    return {k: np.float64(v) for k, v in memory.model_state_bytes(psi, n_d, stage, accounting).items()}


def asserts_the_stage(psi, n_d, stage, accounting="zero"):
    assert stage in (0, 1, 2, 3)
    return memory.model_state_bytes(psi, n_d, stage, accounting)


def zero_accounting_always(psi, n_d, stage, accounting="zero"):
    return memory.model_state_bytes(psi, n_d, stage, "zero")


def in_flight_float(p, m, v=1):
    return float(pipeline.in_flight(p, m, v))


def choose_index(estimates, cap_bytes):
    got = choosing.choose(estimates, cap_bytes)
    return None if got is None else estimates.index(got)


def choose_last_of_ties(estimates, cap_bytes):
    fits = [e for e in estimates if e.memory_bytes_per_gpu <= cap_bytes]
    return max(reversed(fits), key=lambda e: -e.step_time_s) if fits else None


@pytest.mark.parametrize("check, fn, words", [
    (ex12.check_model_state_bytes, numpy_states, "is a numpy.float64"),
    (ex12.check_model_state_bytes, asserts_the_stage, "is a ValueError (raise ValueError(...), not assert)"),
    (ex12.check_model_state_bytes, zero_accounting_always, "that is the ZeRO paper's 2 + 2 + 12"),
    (ex12.check_in_flight, in_flight_float, "return a fractions.Fraction"),
    (ex12.check_choose, choose_index, "return the estimate itself"),
    (ex12.check_choose, choose_last_of_ties, "a tie in step time: the one earlier in the list"),
])
def test_a_wrong_answer_fails_in_words(check, fn, words):
    with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        check(fn)


def called_from_the_package():
    return sys._getframe(2).f_globals.get("__name__", "").startswith("minidist.plan")


def plugged_in(number, fn):
    """The grader's plug-in check of exercise `number` with fn, in this one process."""
    from mpi4py import MPI
    from minidist.grader import plugin
    ex = next(e for e in ex12.EXERCISES if e.number == number)
    session = plugin.PluginSession(MPI.COMM_WORLD)
    try:
        plugin.check(ex, fn, session)
    finally:
        session.free()


def test_only_the_lesson_catches_a_stage_3_that_differs_in_use():
    """Right when the check calls it, the weights whole when the package does: the lesson's
    ZeRO-paper figures differ."""
    ref = memory.model_state_bytes

    def sneaky(psi, n_d, stage, accounting="zero"):
        out = ref(psi, n_d, stage, accounting)
        if called_from_the_package() and stage == 3:
            out["weights"] *= n_d
        return out
    ex12.check_model_state_bytes(sneaky)
    with pytest.raises(AssertionError, match="lesson 12 with your model_state_bytes.*MISMATCH.*DIFFERENT"):
        plugged_in("12.1", sneaky)


def test_only_the_lesson_catches_a_choice_that_ignores_the_cap_in_use():
    ref = choosing.choose

    def sneaky(estimates, cap_bytes):
        if called_from_the_package():
            return min(estimates, key=lambda e: e.step_time_s)
        return ref(estimates, cap_bytes)
    ex12.check_choose(sneaky)
    with pytest.raises(AssertionError, match="lesson 12 with your choose.*MISMATCH.*WRONG"):
        plugged_in("12.4", sneaky)


def test_the_plug_in_run_gives_lesson_12_no_dtype_which_it_does_not_take(capsys):
    from minidist.grader.plugin import Run, lesson_module
    run = ex12.EXERCISES[0].runs[0]
    assert run.dtypes == (None,) and "--dtype" not in run.flags(1, None)
    fsdp = Run("06_fsdp", ("--steps", "1"))
    assert fsdp.flags(2, "float32") == ["--steps", "1", "--dtype", "float32"]
    parser = lesson_module("12_plan").build_parser()
    assert not hasattr(parser.parse_args(list(run.flags(1, None))), "dtype")
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--dtype", "float64"])
    assert stop.value.code == 2 and "unrecognized arguments: --dtype" in capsys.readouterr().err
