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
