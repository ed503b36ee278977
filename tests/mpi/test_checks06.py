"""Exercise 06's checks catch the wrong answers that once passed, on every rank alike.

Called directly (no grader, no plug-in check); the package's answers passing is in
test_checks05.py. The grader's view, with whole students' files: tests/planted/06_*.py.
"""
import numpy as np
import pytest

from minidist.comm import ring_all_gather
from minidist.grader.checks import ex06_fsdp as ex06

pytestmark = pytest.mark.mpi


def test_unit_sizes_are_uneven_at_every_tried_world_size():
    """No tried size divides a unit, and at least two ranks hold the shorter piece: padding
    falls between shards, where cutting the result back to n cannot hide it."""
    for _, _, (i, h, o) in ex06.UNITS:
        n = i * h + h + h * o + o
        assert all(1 <= n % size <= size - 2 for size in (3, 4, 5, 6, 7, 8)), n


def test_a_float64_buffer_fails(comm):
    def zeros(c, group):
        full = np.zeros(group.n)
        full[:] = ring_all_gather(c, group.shard)
        group.point(full)
        return full
    with pytest.raises(AssertionError, match="returned a float64 buffer: keep the unit's dtype float32"):
        ex06.check_gather_params(zeros)


def test_padded_shards_fail(comm):
    if comm.Get_size() < 3:
        pytest.skip("from 2 shards the padding is at the end only (why 6.1 needs 3 ranks)")

    def padded(c, group):
        piece = np.zeros(-(-group.n // c.Get_size()), group.dtype)
        piece[:group.shard.size] = group.shard
        full = ring_all_gather(c, piece)[:group.n]
        group.point(full)
        return full
    with pytest.raises(AssertionError, match="wrong from element"):
        ex06.check_gather_params(padded)


def test_a_buffer_reused_per_size_fails(comm):
    kept = {}

    def reused(c, group):
        full = kept.setdefault((group.n, group.dtype), np.empty(group.n, group.dtype))
        full[:] = ring_all_gather(c, group.shard)
        group.point(full)
        return full
    with pytest.raises(AssertionError, match="a new buffer per call, not one reused"):
        ex06.check_gather_params(reused)


def test_a_free_that_empties_the_shard_or_sets_none_fails(comm):
    def empties(group):
        ex06.fsdp.free_params(group)
        group.shard = np.empty(0, group.dtype)
    with pytest.raises(AssertionError, match="free_params changed group.shard"):
        ex06.check_free_params(empties)

    def none(group):
        for p in group.params:
            p.data = None
    with pytest.raises(AssertionError, match="fc.weight.data is None, not an array"):
        ex06.check_free_params(none)


def test_the_students_own_assert_is_named_as_theirs(comm):
    def asserts(c, group):
        assert False, "not yet"
    with pytest.raises(AssertionError, match="your code's assert failed: not yet"):
        ex06.check_gather_params(asserts)
