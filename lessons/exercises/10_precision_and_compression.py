"""Exercise 10: loss scaling for fp16, 1-bit compression with error feedback, one PowerSGD step.

Five functions, each mirroring the package's by name and signature:

- 10.1 `unscale_grads` and 10.2 `update_scale` (minidist/precision.py): the two halves of
  dynamic loss scaling, which minidist.precision.GradScaler calls every fp16 step.
- 10.3 `onebit_compress` and 10.4 `onebit_decompress` (minidist/parallel/compressors.py):
  signs packed 8 per byte plus one scale, and the residual kept for the next step.
- 10.5 `powersgd_step` (minidist/parallel/powersgd.py): one power iteration of
  PowerSGD on one gradient matrix, summed over ranks with minidist.comm's ring.

10.1 to 10.4 are plain NumPy in one process; 10.5 runs under mpirun. Without mpirun the
grader grades 10.1 to 10.4 in one process and 10.5 in jobs of 3 ranks and of 4 (10.5 is
also checked on groups of 2 ranks and of 1); --only 10.1 10.2 starts no MPI job at all:

    python -m minidist.grade lessons/exercises/10_precision_and_compression.py
    python -m minidist.grade --only 10.1 10.2 -- lessons/exercises/10_precision_and_compression.py
    mpirun -n 3 python -m minidist.grade lessons/exercises/10_precision_and_compression.py --only 10.5

After the unit checks, each check plugs your function into the package and trains a tiny
GPT with it (fp16 with GradScaler; CompressedDataParallel("1bit"); data parallelism with
PowerSGD), against the same run with the package's answer. Return new arrays on every
call and leave the inputs unchanged. Once each passes, the training runs that two of them
share (fp16: 10.1 with 10.2; 1-bit: 10.3 with 10.4) run once more with all of your
functions in the package at once: they must agree with each other, not only with the
package's answers.
"""
import numpy as np  # noqa: F401  (you will want it)


def unscale_grads(grads, scale):
    """The gradients divided by the loss scale, and whether any overflowed.

    grads: a list of NumPy arrays (float16, float32 or float64) or None (a parameter
    without a gradient). Returns (unscaled, found_inf):
      unscaled: a list of the same length, each array divided by scale as a NEW float32
          array (the fp32 master weights are updated with it); None stays None;
      found_inf: True when any gradient holds an inf or a nan: a Python bool, True or
          False (bool(...) of NumPy's answer: np.any returns numpy.bool_, and a caller
          that tests `found_inf is True` would never see a NumPy True).
    The scale is a power of two, so dividing by it is exact.
    """
    raise NotImplementedError("exercise 10.1: unscale_grads")


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    """The next (scale, good_steps) of dynamic loss scaling (PyTorch's GradScaler rule).

    An inf or nan this step (found_inf): scale * backoff_factor, and the count of good
    steps restarts at 0 (the step itself is skipped by the caller). Otherwise this is one
    more good step in a row; the growth_interval-th one multiplies the scale by
    growth_factor and restarts the count at 0.
    found_inf may come as a bool, a numpy.bool_ or 0/1: test its truth (`if found_inf:`),
    never `found_inf is True` (False for numpy.True_ and for 1).
    """
    raise NotImplementedError("exercise 10.2: update_scale")


def onebit_compress(x, residual):
    """Signs of v = x + residual, packed 8 per byte, and one scale: (packed, scale, new_residual).

    x, residual: 1-D arrays of one float dtype and length n (any n, not only multiples of 8).
      packed: numpy.packbits(v >= 0) (uint8, ceil(n/8) bytes; a zero counts as +; the
          default bit order);
      scale: mean |v|, one number in x's dtype (x.dtype.type(...));
      new_residual: v - onebit_decompress(packed, scale, n), in x's dtype: what this step
          did not send, added to the next step's x (error feedback).
    Leave x and residual as they are.
    """
    raise NotImplementedError("exercise 10.3: onebit_compress")


def onebit_decompress(packed, scale, n):
    """The n values +scale (bit 1) or -scale (bit 0) of packed, an array in scale's dtype."""
    raise NotImplementedError("exercise 10.4: onebit_decompress")


def powersgd_step(comm, M, Q):
    """One PowerSGD power iteration on this rank's gradient matrix M: (approx, Q_new).

    M: n x m (error feedback already added); Q: m x r, the same on every rank. With N ranks:
      1. P = M @ Q, summed over ranks with minidist.comm's ring_all_reduce(comm, P);
      2. P = orthogonalize(P): Gram-Schmidt (minidist.parallel.compression.orthogonalize,
         or your own);
      3. Q_new = M.T @ P, summed over ranks the same way;
      4. approx = P @ Q_new.T / N, the rank-r approximation of the average of M.
    Exactly two ring all-reduces, of n x r and m x r numbers: no comm.Allreduce (the
    grader refuses MPI's collectives), no all-reduce of M. New arrays in M's dtype.
    """
    raise NotImplementedError("exercise 10.5: powersgd_step")
