"""Exercise 03's checks pass the package's own answers and catch wrong ones, on every rank.

Called directly (no grader, so no rule about 3 ranks): at 1, 2, 3, 4 and 8 ranks the
package's answers must pass. Each wrong answer here is wrong on every rank alike (or the
test says where it is not); the grader's view of the bugs students write is
tests/test_planted.py.
"""
import numpy as np
import pytest

from minidist.comm import all_reduce, ring_all_gather
from minidist.grader.checks import ex03_tensor_parallel as ex03
from minidist.parallel import tensor_parallel as tp

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("exercise", ex03.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def _many(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank: a sum over ranks is the identity")


def test_an_all_reduce_too_many_fails_on_values_and_bytes(comm):
    _many(comm)
    with pytest.raises(AssertionError, match="the sum over ranks: g's backward is the identity"):
        ex03.check_g_backward(lambda c, grad: all_reduce(c, grad))
    with pytest.raises(AssertionError, match="this rank's part only"):
        ex03.check_f_backward(lambda c, grad: grad)


def test_mpis_own_allreduce_is_refused(comm):
    def mpi(c, x):
        out = np.empty_like(x)
        c.Allreduce(x, out)
        return out
    with pytest.raises(AssertionError, match="called comm.Allreduce: use all_reduce"):
        ex03.check_g_forward(mpi)


def test_no_max_overflows(comm):
    """Without the shift by the max, exp(1000) is inf: the loss is nan."""
    def no_max(c, logits, targets, lo, vocab_size):
        n, v = logits.shape
        pad = (lo + np.arange(v)) >= vocab_size
        e = np.where(pad, 0.0, np.exp(logits))
        inside = (targets >= lo) & (targets < lo + v)
        mine = np.where(inside, logits[np.arange(n), np.where(inside, targets - lo, 0)], 0.0)
        all_reduce(c, np.zeros(n), op="max")                       # the bytes of three all-reduces
        target, s = all_reduce(c, mine), all_reduce(c, e.sum(axis=1))
        return (np.log(s) - target).mean(), e / s[:, None]
    with np.errstate(all="ignore"), pytest.raises(AssertionError, match="the loss of the vocab-parallel loss"):
        ex03.check_vocab_parallel_cross_entropy_forward(no_max)


def test_gathering_the_logits_fails_the_bytes(comm):
    """The right values from the whole logits gathered: b*s*v bytes instead of 3 b*s."""
    _many(comm)

    def gathered(c, logits, targets, lo, vocab_size):
        whole = ring_all_gather(c, logits, axis=1)[:, :vocab_size]
        m = whole.max(axis=1, keepdims=True)
        e = np.exp(whole - m)
        s = e.sum(axis=1)
        loss = np.mean(np.log(s) + m[:, 0] - whole[np.arange(len(targets)), targets])
        probs = np.zeros_like(logits)
        hi = min(lo + logits.shape[1], vocab_size)
        probs[:, :max(hi - lo, 0)] = (e / s[:, None])[:, lo:hi]
        return loss, probs
    with pytest.raises(AssertionError, match="the size of the whole logits"):
        ex03.check_vocab_parallel_cross_entropy_forward(gathered)


def test_the_padding_must_count_as_minus_infinity(comm):
    _many(comm)                                                     # one rank: nothing is padded
    def unmasked(c, logits, targets, lo, vocab_size):
        return tp.vocab_parallel_cross_entropy_forward(c, logits, targets, lo, 10**9)
    with pytest.raises(AssertionError, match="vocab-parallel loss"):
        ex03.check_vocab_parallel_cross_entropy_forward(unmasked)


def test_the_wrong_axis_fails(comm):
    with pytest.raises(AssertionError, match="is cut along axis 1"):
        ex03.check_split_for_rank(lambda a, axis, rank, t: tp.split_for_rank(a, 0, rank, t))


# ----------------------------------------------------------------------------- float32, repeated calls, padding, frames

def test_a_float64_result_fails_in_float32(comm):
    """np.zeros(n) is float64: a float32 run must say so, not pass on the values."""
    def widened(c, logits, targets, lo, vocab_size):
        loss, probs = tp.vocab_parallel_cross_entropy_forward(c, logits, targets, lo, vocab_size)
        return loss, probs.astype(np.float64)
    with pytest.raises(AssertionError, match="probs of the vocab-parallel loss, case 1, float32.*the result is "
                                             "float64, the logits is float32"):
        ex03.check_vocab_parallel_cross_entropy_forward(widened)
    with pytest.raises(AssertionError, match="float32.*the result is float64, probs is float32"):
        ex03.check_vocab_parallel_cross_entropy_backward(
            lambda p, t, lo, g: tp.vocab_parallel_cross_entropy_backward(p, t, lo, g).astype(np.float64))


def test_a_value_a_little_off_names_the_dtype_and_the_tolerance(comm):
    def off(c, x):
        return tp.g_forward(c, x) * (1 + 1e-4) if x.dtype == np.float32 else tp.g_forward(c, x)
    with pytest.raises(AssertionError, match=r"float32: at \[.*off by .*the float32 tolerance is 1e-05 x "
                                             r"max\(\|expected\|, 1\)"):
        ex03.check_g_forward(off)


def test_an_output_buffer_reused_per_shape_fails(comm):
    buffers = {}

    def reused(c, x):
        out = buffers.setdefault((x.shape, x.dtype), np.empty_like(x))
        out[...] = x
        return out
    with pytest.raises(AssertionError, match="returned in call 1 .* changed when g's backward was called again "
                                             "with other inputs of the same shape, in call 3"):
        ex03.check_g_backward(reused)


def test_padding_on_several_ranks_must_be_masked_on_each(comm):
    if comm.Get_size() < 3:
        pytest.skip("below 3 ranks the padding fits on the last rank")

    def last_rank_only(c, logits, targets, lo, vocab_size):
        z = logits.copy()
        if c.Get_rank() == c.Get_size() - 1:
            z[:, max(vocab_size - lo, 0):] = -np.inf
        return tp.vocab_parallel_cross_entropy_forward(c, z, targets, lo, 10**9)
    with np.errstate(all="ignore"), pytest.raises(AssertionError, match="padding masked on the last rank only"):
        ex03.check_vocab_parallel_cross_entropy_forward(last_rank_only)


def test_no_frame_holds_the_answer_while_the_student_runs(comm):
    """While the student's function runs, every array in the frames above it is one of its
    inputs, a copy of one, or a result it returned earlier: never the whole problem, another
    rank's part or an expected value (the cheat of reading sys._getframe(1).f_locals).
    A property of the checks' code, not of the world size: tried at 3 ranks only."""
    import sys
    if comm.Get_size() != 3:
        pytest.skip("tried at 3 ranks")
    returned, strangers = [], []

    def spy(reference):
        def fn(*args):
            mine = [a for a in args if isinstance(a, np.ndarray)]
            strangers.extend(("base of an input", a.base.shape) for a in mine if a.base is not None)
            known = mine + returned[-3:]                  # the inputs, the previous call's results
            f = sys._getframe(1)
            while f is not None and f.f_globals.get("__name__") != __name__:   # up to this test's own frame
                for name, value in f.f_locals.items():
                    for a in value if isinstance(value, (list, tuple)) else [value]:
                        if not isinstance(a, np.ndarray) or any(a is b for b in known):
                            continue
                        if not any(a.shape == b.shape and np.array_equal(a, b) for b in known):
                            strangers.append((f.f_code.co_name, name, a.shape))
                f = f.f_back
            out = reference(*args)
            returned.extend(o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, np.ndarray))
            return out
        fn.__name__ = reference.__name__
        return fn
    for exercise in ex03.EXERCISES:
        returned.clear()
        exercise.check(spy(exercise.reference))
        assert not strangers, (exercise.number, strangers[:5])


def test_every_exercise_has_its_lesson_run(comm):
    """The plug-in check runs lesson 03 (at any graded size, n heads of 4 channels) for every
    exercise: the package's layers look the column and row functions up by name when they run."""
    for e in ex03.EXERCISES:
        assert e.runs == ex03.RUNS, e.number
    for n in (3, 4, 5):
        flags = ex03.RUNS[0].flags(n, "float32")
        assert int(flags[flags.index("--n-head") + 1]) == n and int(flags[flags.index("--n-embd") + 1]) % n == 0
