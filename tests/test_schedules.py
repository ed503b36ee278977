"""Pipeline schedules as data: every one valid, the simulator's bubble equal to the formula,
peak live activations as the papers say, and the validator catching what students write."""
from fractions import Fraction

import pytest

from minidist.parallel import schedules as S
from minidist.plan.pipeline import bubble_fraction

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
            assert got == bubble_fraction(name, p, m, costs=costs), (name, p, m, got)
        for v in (2, 3, 4):
            if m % p == 0:
                got = S.simulate(S.interleaved_1f1b(p, m, v), p, m, v, costs=costs).bubble
                assert got == bubble_fraction("interleaved", p, m, v, costs=costs) == Fraction(p - 1, v * m + p - 1)


def test_zero_bubble_h1_meets_the_papers_figure_at_1f1b_memory():
    """ZB-H1 with F = B = W: total time m(f+b) + (p-1)(f+B-W), peak live <= p on every rank."""
    for p, m in PM:
        sim = S.simulate(S.zero_bubble_h1(p, m), p, m, costs=(1, 2, 1))
        if m >= p:
            assert sim.bubble == bubble_fraction("zb-h1", p, m), (p, m)
            assert sim.bubble < bubble_fraction("1f1b", p, m) or p == 1
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
    assert S.simulate(sch, p, m).bubble > bubble_fraction("1f1b", p, m)


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


# ----------------------------------------------------------------------------- the interleaved warm-up and latency

INTERLEAVED = [(p, m, v) for p in range(1, 9) for m in range(p, 17, p) for v in (2, 3, 4)]


def test_interleaved_warmup_per_rank_is_megatrons():
    """Rank r runs W = min(2(p-r-1) + (v-1)p, m v) forwards, then m v - W pairs of one forward
    and one backward, then W backwards (Megatron-LM's and PyTorch's count). Dropping the
    factor 2 keeps the schedule valid and the bubble equal with free messages: only this
    pins it (the latency test below shows what it is for)."""
    for p, m, v in INTERLEAVED:
        sch, n = S.interleaved_1f1b(p, m, v), m * v
        for r, acts in enumerate(sch):
            want = min(2 * (p - r - 1) + (v - 1) * p, n)
            ops = "".join(a[0] for a in acts)
            shape = "F" * want + "FB" * (n - want) + "B" * want
            lead = len(ops) - len(ops.lstrip("F"))
            assert ops == shape, (f"interleaved_1f1b({p}, {m}, {v}), rank {r}: warm-up of {lead - (lead < n)} "
                                  f"forwards, the formula 2(p-r-1) + (v-1)p capped at m v gives {want}")


def test_latency_is_paid_on_fill_and_drain_only_with_the_factor_2():
    """A message latency lam (up to one chunk's forward) lengthens the interleaved step by
    exactly 2(pv-1) lam: the first micro-batch's way down, the last one's way back. Without
    the factor 2 in the warm-up, the same bubble with free messages and a lower peak, but a
    longer step as soon as messages take time (p = 4, m = 8, v = 2: 0.207 against 0.256
    with a quarter of a chunk's forward)."""
    cases = [(p, m, v) for p in range(2, 7) for m in (p, 2 * p) for v in (2, 3)] + [(4, 8, 4), (8, 16, 2)]
    for p, m, v in cases:
        with_2, without = S.interleaved_1f1b(p, m, v), S.interleaved_1f1b(p, m, v, warmup_factor=1)
        free = S.simulate(with_2, p, m, v)
        free_1 = S.simulate(without, p, m, v)
        assert free_1.bubble == free.bubble and free_1.peak <= free.peak, (p, m, v)
        for lam in (Fraction(1, 4), Fraction(1)):             # in chunk forwards (f = 1, a chunk f/v)
            late = S.simulate(with_2, p, m, v, latency=lam / v)
            assert late.total == free.total + 2 * (p * v - 1) * lam / v, (p, m, v, lam, late.total, free.total)
            late_1 = S.simulate(without, p, m, v, latency=lam / v)
            if without != with_2:                              # (capped alike when m = p, v = 2, p = 2)
                assert late_1.bubble > late.bubble, (p, m, v, lam, late_1.bubble, late.bubble)
    late = [S.simulate(S.interleaved_1f1b(4, 8, 2, k), 4, 8, 2, latency=Fraction(1, 8)).bubble for k in (2, 1)]
    assert [round(float(b), 3) for b in late] == [0.207, 0.256]


def test_latency_in_the_simulator_and_the_picture():
    """GPipe on 2 ranks with messages of one forward, worked by hand; a message to the same
    rank (one rank, two chunks) takes no time; 0 is the default."""
    sch = S.gpipe(2, 2)
    sim = S.simulate(sch, 2, 2, latency=1)
    assert sim.start[(1, ("F", 0, 0))] == 2 and sim.start[(0, ("B", 0, 0))] == 7 and sim.total == 11
    assert S.picture(sch, latency=1).splitlines() == ["rank 0  F0 F1 .. .. .. .. .. B0 -- B1 --",
                                                      "rank 1  .. .. F0 F1 B0 -- B1 -- .. .. .."]
    assert S.simulate(sch, 2, 2, latency=0).start == S.simulate(sch, 2, 2).start
    one = S.interleaved_1f1b(1, 3, 2)
    assert S.simulate(one, 1, 3, 2, latency=5).total == S.simulate(one, 1, 3, 2).total
    with pytest.raises(ValueError, match="negative"):
        S.simulate(sch, 2, 2, latency=-1)


def test_picture_wraps_at_a_width():
    sch = S.interleaved_1f1b(4, 8, 2)
    whole = S.picture(sch, v=2).splitlines()
    wrapped = S.picture(sch, v=2, width=100).splitlines()
    assert max(map(len, wrapped)) <= 100 < max(map(len, whole))
    assert wrapped[0].strip() == "t = 0" and wrapped[6].strip() == "t = 18"
    rows = [" ".join(line[8:] for line in wrapped if line.startswith(f"rank {r}")) for r in range(4)]
    assert rows == [line[8:] for line in whole]
