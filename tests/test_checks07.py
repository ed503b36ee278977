"""The lesson-07 checks pass the package's own answers and catch the usual wrong ones."""
import pytest

from minidist.grader.checks.ex07_3d_parallel import EXERCISES, check_coords, check_group, factorisations


def test_factorisations_of_8_are_every_tp_pp_dp():
    assert sorted(factorisations(8)) == sorted([(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2),
                                                (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)])


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_check_passes_the_package_answer(ex):
    ex.check(ex.reference)


def test_pp_fastest_fails():
    def pp_fastest(rank, tp, pp, dp):
        return rank // (pp * tp), rank % pp, (rank // pp) % tp
    with pytest.raises(AssertionError, match="tp varies fastest"):
        check_coords(pp_fastest)


def test_group_off_by_one_fails():
    def short(rank, kind, tp, pp, dp):
        d, p, t = rank // (tp * pp), (rank // tp) % pp, rank % tp
        if kind == "dp":
            return [i * pp * tp + p * tp + t for i in range(dp - 1)]
        return {"tp": [d * pp * tp + p * tp + i for i in range(tp)],
                "pp": [d * pp * tp + i * tp + t for i in range(pp)]}[kind]
    with pytest.raises(AssertionError, match="expected"):
        check_group(short)


def test_unknown_kind_must_raise():
    from minidist.comm.grid import grid_group

    def lenient(rank, kind, tp, pp, dp):
        return [] if kind not in ("tp", "pp", "dp") else grid_group(rank, kind, tp, pp, dp)
    with pytest.raises(AssertionError, match="ValueError"):
        check_group(lenient)


def _group(rank, kind, tp, pp, dp):
    d, p, t = rank // (tp * pp), (rank // tp) % pp, rank % tp
    members = {"tp": [d * pp * tp + p * tp + i for i in range(tp)], "pp": [d * pp * tp + i * tp + t for i in range(pp)],
               "dp": [i * pp * tp + p * tp + t for i in range(dp)]}
    if kind not in members:
        raise ValueError(kind)
    return members[kind]


def test_reading_the_expected_value_from_the_checks_frames_fails():
    """The expected group is computed after grid_group returns: no frame holds it while it runs."""
    import sys

    def reads_frames(rank, kind, tp, pp, dp):
        _group(rank, kind, tp, pp, dp)                 # the ValueError of an unknown kind
        frame = sys._getframe(1)
        while frame is not None:
            for value in frame.f_locals.values():
                if isinstance(value, dict) and isinstance(value.get(kind), list):
                    return list(value[kind])
            for name in ("w", "want", "expected"):
                if isinstance(frame.f_locals.get(name), list):
                    return list(frame.f_locals[name])
            frame = frame.f_back
        return [rank]
    with pytest.raises(AssertionError, match=r"returned \[0\], expected \[0, 1\]"):
        check_group(reads_frames)


def test_a_generator_is_named_as_such():
    with pytest.raises(AssertionError, match="returned a generator; a list of the group's world ranks is expected"):
        check_group(lambda *a: (m for m in _group(*a)))
    with pytest.raises(AssertionError, match="returned a generator"):
        check_coords(lambda r, tp, pp, dp: (x for x in (r // (tp * pp), (r // tp) % pp, r % tp)))


def test_a_list_reused_between_calls_fails():
    kept = []

    def reused(*args):
        kept[:] = _group(*args)
        return kept
    with pytest.raises(AssertionError, match="when grid_group was called again with other arguments"):
        check_group(reused)


def test_the_students_own_assert_is_named_as_theirs():
    def asserts(rank, kind, tp, pp, dp):
        assert tp * pp * dp <= 16, "too many ranks"
        return _group(rank, kind, tp, pp, dp)
    with pytest.raises(AssertionError, match="your code's assert failed: too many ranks"):
        check_group(asserts)


def test_grid_coords_and_grid_group_are_plugged_into_lesson_07_on_4_ranks():
    from minidist.grader.plugin import Run
    for ex in EXERCISES:         # ProcessGrid computes coordinates and builds its communicators with them
        assert ex.runs and all(isinstance(r, Run) and r.lesson == "07_3d_parallel" and r.ranks == 4
                               for r in ex.runs)
