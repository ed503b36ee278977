"""Exercise 11's checks: the package's answers pass, wrong ones fail in words that name the
mistake, the round trip (the function plugged into minidist.checkpoint) catches what the
unit cases alone would not, and the exercise file as shipped grades TODO. (The grader's
view, with planted files: tests/test_planted.py.)"""
import sys

import numpy as np
import pytest

from minidist.checkpoint import layouts, read as reader
from minidist.grader import command as grade
from minidist.grader.checks import ex11_checkpoints as ex11
from minidist.parallel.tp_model import Shard

STUBS = grade.Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "11_checkpoints.py"


@pytest.mark.parametrize("exercise", ex11.EXERCISES, ids=lambda e: e.name)
def test_the_package_answer_passes(exercise):
    exercise.check(exercise.reference)


def test_the_stubs_are_todo():
    rows = grade.Grader(timeout=30, out=lambda *_: None).grade(str(STUBS), "11_checkpoints")
    assert [r["verdict"] for r in rows] == ["TODO"] * 2, rows
    assert [r["exercise"] for r in rows] == ["11.1", "11.2"]


@pytest.mark.parametrize("shape, spec, t", [((4, 30), None, 3), ((35, 10), Shard(0, size=35, padded=36), 4),
                                            ((4, 30), Shard(1, blocks=3), 4), ((5, 3), Shard(0, size=5, padded=8), 4),
                                            ((4, 30), Shard(1, blocks=3), 7), ((), None, 2)])
def test_the_referee_agrees_with_the_package(shape, spec, t):
    from minidist.parallel.tp_model import shard
    for rank in range(t):
        local = shard(np.zeros(shape), spec, rank, t).shape
        want = layouts.tp_regions(shape, spec, rank, t)
        got = ex11.referee_regions(shape, spec, rank, t)
        assert [b for b, _ in got] == [b for b, _ in want]
        assert [loc for _, loc in got] == [[s.indices(n)[:2] for s, n in zip(i, local)] for _, i in want]


def numpy_ints(full_shape, spec, rank, t):
    return [([[np.int64(a), np.int64(b)] for a, b in box], index)
            for box, index in layouts.tp_regions(full_shape, spec, rank, t)]


def fancy_index(full_shape, spec, rank, t):
    """The cut axis indexed by a list of positions: a copy, not a view (loading would write nowhere)."""
    out = []
    for box, index in layouts.tp_regions(full_shape, spec, rank, t):
        if spec is not None:
            index = tuple(list(range(*s.indices(10 ** 6))) if k == spec.axis else s for k, s in enumerate(index))
        out.append((box, index))
    return out


def changes_spec(full_shape, spec, rank, t):
    out = layouts.tp_regions(full_shape, spec, rank, t)
    if spec is not None:
        spec.padded = spec.padded
        spec.blocks = int(spec.blocks) + 0
        spec.extra = 1
    return out


def numpy_bool(out, out_box, piece, piece_box):
    return np.bool_(reader.copy_overlap(out, out_box, piece, piece_box))


def rebinds_out(out, out_box, piece, piece_box):
    out = out.copy()
    return reader.copy_overlap(out, out_box, piece, piece_box)


@pytest.mark.parametrize("check, fn, words", [
    (ex11.check_tp_regions, numpy_ints, "write Python ints"),
    (ex11.check_tp_regions, fancy_index, "a tuple of slices (step 1)"),
    (ex11.check_tp_regions, changes_spec, "changed the spec"),
    (ex11.check_tp_regions, lambda *a: layouts.tp_regions(*a)[:1], "one box per block"),
    (ex11.check_copy_overlap, numpy_bool, "return a bool"),
    (ex11.check_copy_overlap, rebinds_out, "write into it in place"),
])
def test_a_wrong_answer_fails_in_words(check, fn, words):
    with pytest.raises(AssertionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check(fn)


def called_from_the_package():
    return sys._getframe(2).f_globals.get("__name__", "").startswith(("minidist.checkpoint", "minidist.parallel"))


def test_only_the_round_trip_catches_a_tp_regions_that_differs_in_use():
    """Right when the check calls it, the padding kept when layouts.held_pieces does: the
    checkpoint refuses the box (it lies outside the tensor)."""
    ref = layouts.tp_regions

    def sneaky(full_shape, spec, rank, t):
        out = ref(full_shape, spec, rank, t)
        if called_from_the_package() and spec is not None and spec.padded not in (None, spec.size) and out:
            box, index = out[-1]
            box = [list(p) for p in box]
            box[spec.axis][1] = spec.padded if rank == t - 1 else box[spec.axis][1]
            out[-1] = (box, index)
        return out
    words = "saved as 2 tensor-parallel ranks.*your tp_regions.*the checkpoint refused it"
    with pytest.raises(AssertionError, match=words):
        ex11.check_tp_regions(sneaky)


def test_only_the_round_trip_catches_a_copy_overlap_that_differs_in_use():
    ref = reader.copy_overlap

    def sneaky(out, out_box, piece, piece_box):
        got = ref(out, out_box, piece, piece_box)
        if called_from_the_package() and out.size:
            out.reshape(-1)[0] += 1
        return got
    with pytest.raises(AssertionError, match="differs from the one saved.*the package's own copy_overlap"):
        ex11.check_copy_overlap(sneaky)
