"""Dropout against an independent expectation, not only against itself.

Dropout zeroes each element with probability p and scales the survivors by 1/(1-p), so
the expected output equals the input. The checks below hold minidist's masks to that
definition with numbers worked out here, from the binomial distribution:
- on n elements the kept count is Binomial(n, 1-p): mean n(1-p), standard deviation
  sqrt(n p (1-p)); it must lie within 6 of those deviations (a correct mask fails that
  about once in 500 million runs);
- every kept value is exactly 1/(1-p) in the tensor's dtype (the input times it);
- the mask is a function of (seed, step, sample id, call) alone: the same four give the
  same mask wherever the sample sits in a batch, any other four another one, and two
  calls' masks are independent (both keep a position with probability (1-p)^2).

Each check is also run on a deliberately wrong dropout (keeping with probability p
instead of 1-p; scaling by 1/p; drawing by row instead of by sample) and must fail:
a check that cannot fail proves nothing.
"""
import math

import numpy as np
import pytest

from minidist import ops
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor

SIGMAS = 6
ROWS, COLS = 8, 125_000          # a million elements per mask


# ----------------------------------------------------------------------------- the checks

def within_binomial(count, n, q, what):
    """Assert count ~ Binomial(n, q) within SIGMAS standard deviations."""
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    assert abs(count - mean) <= SIGMAS * sd, (
        f"{what}: {count:,} of {n:,} ({count / n:.4f}), expected {mean:,.0f} ({q:.4f}) "
        f"+- {SIGMAS} x {sd:,.0f}")


def check_kept_fraction(rng_class, p, dtype=np.float64):
    """The kept fraction of a large dropout output is 1-p, overall and in every row (sample)."""
    x = Tensor(np.ones((ROWS, COLS), dtype))
    y = ops.dropout(x, p, rng_class(0, 0, range(ROWS))).data
    kept = y != 0
    within_binomial(int(kept.sum()), kept.size, 1 - p, f"kept fraction at p={p}")
    for r in range(ROWS):
        within_binomial(int(kept[r].sum()), COLS, 1 - p, f"kept fraction of sample {r} at p={p}")


def check_scale(rng_class, p, dtype):
    """Kept values are the input times exactly 1/(1-p) (rounded once to dtype); the rest are 0."""
    x = np.random.default_rng(1).standard_normal((4, 5000)).astype(dtype) + dtype(3.0)  # never 0
    y = ops.dropout(Tensor(x), p, rng_class(3, 1, range(4))).data
    assert y.dtype == dtype
    kept = y != 0
    assert 0 < kept.sum() < kept.size
    scale = dtype(1.0 / (1.0 - p))
    np.testing.assert_array_equal(y[kept], x[kept] * scale, err_msg=f"kept values must be x / (1-p), p={p}")
    mask = rng_class(3, 1, range(4)).mask((4, 5000), p, dtype)
    assert set(np.unique(mask).tolist()) == {0.0, float(scale)}, f"mask values {np.unique(mask)}"


def check_identity(rng_class, p=0.3, shape=(3, 64, 64)):
    """Masks depend on (seed, step, sample id, call) and nothing else."""
    def mask(seed, step, ids, call=0, dtype=np.float64):
        rng = rng_class(seed, step, ids)
        for _ in range(call):
            rng.mask((len(ids),) + shape, p, dtype)
        return rng.mask((len(ids),) + shape, p, dtype)

    base = mask(5, 2, [7])[0]
    np.testing.assert_array_equal(mask(5, 2, [7])[0], base, err_msg="same (seed, step, sample, call): same mask")
    np.testing.assert_array_equal(mask(5, 2, [4, 9, 7])[2], base,
                                  err_msg="sample 7 third in a batch (another rank's shard): same mask")
    np.testing.assert_array_equal(mask(5, 2, [7], dtype=np.float32)[0] != 0, base != 0,
                                  err_msg="float32 keeps the same positions")
    for what, other in (("seed", mask(6, 2, [7])[0]), ("step", mask(5, 3, [7])[0]),
                        ("sample", mask(5, 2, [8])[0]), ("call", mask(5, 2, [7], call=1)[0])):
        assert not np.array_equal(other != 0, base != 0), f"another {what} must give another mask"
        both = int(((other != 0) & (base != 0)).sum())      # independent draws: (1-p)^2
        within_binomial(both, base.size, (1 - p) ** 2, f"positions kept by both masks (another {what})")


# ----------------------------------------------------------------------------- minidist's dropout

@pytest.mark.parametrize("p", [0.1, 0.3, 0.7])
def test_kept_fraction_is_one_minus_p(p):
    check_kept_fraction(DropoutRNG, p)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.7])
def test_kept_values_are_scaled_by_exactly_one_over_one_minus_p(p, dtype):
    check_scale(DropoutRNG, p, dtype)


def test_masks_depend_on_seed_step_sample_and_call_only():
    check_identity(DropoutRNG)


def test_expected_output_equals_the_input():
    """E[dropout(x)] = x: the mean over a million elements of dropout(1) is 1 within 6 sigma."""
    p = 0.2
    y = ops.dropout(Tensor(np.ones((ROWS, COLS))), p, DropoutRNG(9, 0, range(ROWS))).data
    sd = math.sqrt(p / (1 - p) / y.size)          # each output is 0 or 1/(1-p): variance p/(1-p)
    assert abs(y.mean() - 1.0) <= SIGMAS * sd, f"mean {y.mean():.5f}"


def test_attention_dropout_keeps_one_minus_p():
    """The fused attention draws its mask from the same DropoutRNG: kept probabilities."""
    p, B, nh, T, hs = 0.25, 2, 4, 64, 8
    rng = np.random.default_rng(0)
    q, k = Tensor(rng.standard_normal((B, nh, T, hs))), Tensor(rng.standard_normal((B, nh, T, hs)))
    eye = np.broadcast_to(np.eye(T), (B, nh, T, T)).copy()   # v = identity: y is the dropped attention itself
    y = ops.causal_attention(q, k, Tensor(eye), p, DropoutRNG(1, 0, range(B))).data
    causal = np.tril(np.ones((T, T), bool))
    kept = (y != 0)[..., causal]
    within_binomial(int(kept.sum()), kept.size, 1 - p, "attention probabilities kept")
    probs = ops.causal_attention(q, k, Tensor(eye)).data     # the same without dropout
    np.testing.assert_allclose(y[y != 0], probs[y != 0] / (1 - p), rtol=1e-12)

# ----------------------------------------------------------------------------- the checks can fail


class KeepsWithProbabilityP(DropoutRNG):
    """The planted bug: keep where the draw is < p, i.e. keep with probability p."""

    def mask(self, shape, p, dtype):
        k, self.calls = self.calls, self.calls + 1
        out = np.empty(tuple(shape), dtype=dtype)
        for row, sid in enumerate(self.sample_ids):
            keep = np.random.default_rng([self.seed, self.step, sid, k]).random(shape[1:], dtype=np.float32) < p
            np.multiply(keep, 1.0 / (1.0 - p), out=out[row], casting="unsafe")
        return out


class ScalesByOneOverP(DropoutRNG):
    """The planted bug: the right positions, the survivors scaled by 1/p."""

    def mask(self, shape, p, dtype):
        m = super().mask(shape, p, dtype)
        return (m != 0).astype(dtype) * np.dtype(dtype).type(1.0 / p)


class DrawsByRow(DropoutRNG):
    """The planted bug: the generator follows the row in this batch, not the sample id."""

    def mask(self, shape, p, dtype):
        ids, self.sample_ids = self.sample_ids, list(range(len(self.sample_ids)))
        try:
            return super().mask(shape, p, dtype)
        finally:
            self.sample_ids = ids


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_keeping_with_probability_p_is_caught(p):
    with pytest.raises(AssertionError, match="kept fraction"):
        check_kept_fraction(KeepsWithProbabilityP, p)


def test_a_wrong_scale_is_caught():
    with pytest.raises(AssertionError, match="kept values must be x / \\(1-p\\)"):
        check_scale(ScalesByOneOverP, 0.3, np.float64)


def test_masks_drawn_by_row_are_caught():
    with pytest.raises(AssertionError, match="another rank's shard"):
        check_identity(DrawsByRow)
