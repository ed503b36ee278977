"""Pipeline schedules as data: every one valid, the simulator's bubble equal to the formula,
peak live activations as the papers say, and the validator catching what students write."""
from fractions import Fraction

import pytest

from minidist.parallel import schedules as S

PM = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b", "zb-h1"])
def test_every_schedule_is_valid(name):
    for p, m in PM:
        assert S.validate(S.build(name, p, m), p, m)


def test_interleaved_is_valid():
    for p, m in PM:
        for v in (1, 2, 3, 4):
            if m % p == 0:
                assert S.validate(S.interleaved_1f1b(p, m, v), p, m, v)


@pytest.mark.parametrize("costs", [(1, 1, 1), (1, 2, 1), (2, 3, 1)])
def test_simulated_bubble_equals_the_formula(costs):
    """Exactly (Fractions), for any forward and backward cost, p <= 8, m <= 16."""
    for p, m in PM:
        for name in ("naive", "gpipe", "1f1b"):
            got = S.simulate(S.build(name, p, m), p, m, costs=costs).bubble
            assert got == S.formula(name, p, m, costs=costs), (name, p, m, got)
        for v in (2, 3, 4):
            if m % p == 0:
                got = S.simulate(S.interleaved_1f1b(p, m, v), p, m, v, costs=costs).bubble
                assert got == S.formula("interleaved", p, m, v, costs=costs) == Fraction(p - 1, v * m + p - 1)


def test_zero_bubble_h1_meets_the_papers_figure_at_1f1b_memory():
    """ZB-H1 with F = B = W: total time m(f+b) + (p-1)(f+B-W), peak live <= p on every rank."""
    for p, m in PM:
        sim = S.simulate(S.zero_bubble_h1(p, m), p, m, costs=(1, 2, 1))
        if m >= p:
            assert sim.bubble == S.formula("zb-h1", p, m), (p, m)
            assert sim.bubble < S.formula("1f1b", p, m) or p == 1
        assert max(sim.peak) <= p, (p, m, sim.peak)


def test_peak_live_activations():
    for p, m in PM:
        assert S.simulate(S.gpipe(p, m), p, m).peak == [m] * p
        assert S.simulate(S.one_f_one_b(p, m), p, m).peak == [min(p - r, m) for r in range(p)]
        assert S.simulate(S.naive(p, m), p, m).peak == [1] * p


def test_one_f_one_b_shape():
    assert S.one_f_one_b(3, 4)[0] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("F", 3, 0),
                                      ("B", 1, 0), ("B", 2, 0), ("B", 3, 0)]
    assert S.one_f_one_b(3, 4)[2][:4] == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]


# ----------------------------------------------------------------------------- the validator's refusals

def _warmup_off_by_one(p, m):
    """A 1F1B whose warm-up is one forward short on every rank."""
    out = []
    for r in range(p):
        w = min(max(p - r - 2, 0), m)
        acts = [("F", i, 0) for i in range(w)]
        for i in range(m - w):
            acts += [("F", w + i, 0), ("B", i, 0)]
        out.append(acts + [("B", i, 0) for i in range(m - w, m)])
    return out


def test_validator_refusals():
    good = S.one_f_one_b(3, 4)
    bad = [list(a) for a in good]
    bad[1][0], bad[1][1] = bad[1][1], bad[1][0]       # F1 before F0: legal, still valid
    assert S.validate(bad, 3, 4)
    before = [list(a) for a in good]
    before[2] = [("B", 0, 0), ("F", 0, 0)] + before[2][2:]
    with pytest.raises(S.ScheduleError, match="rank 2 runs B0 before F0"):
        S.validate(before, 3, 4)
    twice = [list(a) for a in good]
    twice[0][1] = ("F", 0, 0)
    with pytest.raises(S.ScheduleError, match="rank 0 lists F0 twice"):
        S.validate(twice, 3, 4)
    missing = [list(a) for a in good]
    missing[1] = missing[1][:-1]
    with pytest.raises(S.ScheduleError, match="rank 1 never runs B3"):
        S.validate(missing, 3, 4)
    with pytest.raises(S.ScheduleError, match="not an action"):
        S.validate([[("X", 0, 0)]], 1, 1)
    with pytest.raises(S.ScheduleError, match="3 rank lists"):
        S.validate(good, 2, 4)
    # backwards in reverse order on one rank, forward order on the next: they wait on each other
    crossed = S.gpipe(2, 2)
    crossed[0] = [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]
    assert S.validate(crossed, 2, 2)                  # waits for B1 from rank 1, which comes after B0: fine
    dead = [[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)], [("F", 1, 0), ("B", 1, 0), ("F", 0, 0), ("B", 0, 0)]]
    with pytest.raises(S.ScheduleError, match="deadlock: rank 0 waits at B0 for rank 1's B0; rank 1 waits at F1"):
        S.validate(dead, 2, 2)


def test_off_by_one_warmup_is_valid_but_its_bubble_is_not_1f1b():
    """What the grader's check adds to the validator: the bubble and the memory of 1F1B."""
    p, m = 4, 8
    sch = _warmup_off_by_one(p, m)
    assert S.validate(sch, p, m)
    assert S.simulate(sch, p, m).bubble > S.formula("1f1b", p, m)


def test_interleaved_refuses_m_not_a_multiple_of_p():
    with pytest.raises(S.ScheduleError, match="multiple of the stages"):
        S.interleaved_1f1b(4, 6, 2)
    with pytest.raises(S.ScheduleError, match="unknown schedule"):
        S.build("pipedream", 2, 2)


def test_picture():
    pic = S.picture(S.gpipe(2, 2)).splitlines()
    assert pic == ["rank 0  F0 F1 .. .. .. B0 -- B1 --",
                   "rank 1  .. F0 F1 B0 -- B1 -- .. .."]
    assert "F1.1" in S.picture(S.interleaved_1f1b(2, 2, 2), v=2)
