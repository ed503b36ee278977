"""Checks for lessons/exercises/10_precision_and_compression.py: loss scaling, 1-bit
compression with error feedback, one PowerSGD step.

Each function is compared with a referee written here again, as plainly as the rule
reads, on many inputs, and only after the student's function has returned. Every check
also asks for new arrays (the inputs unchanged, no result sharing memory with an input,
the results of earlier calls unchanged by later ones) and the dtypes the package uses.
Then it plugs the function into the package and trains something real with it, against
the same run with the package's own answer:

- 10.1 unscale_grads(grads, scale): float16, float32 and float64 gradients (None among
  them, shapes with 0 and odd numbers of elements); scales that are powers of two
  (2^16, 2^-3, 1: then the result must be exact, bit for bit) and that are not (3: within
  two float32 ulps); an inf, a -inf, a nan alone. The result is fp32, found_inf a Python
  bool (not numpy.bool_: a caller may test it with `is True`).
- 10.2 update_scale(scale, good_steps, found_inf, growth_factor, backoff_factor,
  growth_interval): hand-made steps (growth at exactly the interval, an inf that resets
  the count), found_inf given in turn as a bool, a numpy.bool_ and 0/1, and long runs
  of random infs at intervals 1, 2, 3, 7 and 2000, with the default factors and with
  others, every (scale, good_steps) compared.
  Both 10.1 and 10.2 then train a tiny GPT in fp16 with minidist.precision's
  MixedPrecision and GradScaler (its loss scale starting at 2^19, so the first steps
  overflow and are skipped, later ones grow it) for 8 steps: the losses, the scale's
  history and every weight must equal the package's own run, bit for bit. Lesson 10's
  fp16 run (the plug-in check) must also skip as many steps and reach the same
  validation loss as the package's own run, with each function alone and with 10.1 and
  10.2 plugged in together: its MATCH (the exact checks) does not look at them, and a
  scale that never backs off skips every step and still MATCHes.
- 10.3 onebit_compress(x, residual) and 10.4 onebit_decompress(packed, scale, n):
  float32 and float64, n from 1 to 100 (most not multiples of 8), exact zeros in
  v = x + residual (a zero is +), residuals large enough to flip signs, inputs that are
  views into larger arrays (as CompressedDataParallel passes them). packed must be
  numpy.packbits's bytes of (v >= 0) exactly (the default big bit order); scale the mean
  of |v|; the new residual v minus the decompressed vector. Then 3 steps of
  CompressedDataParallel("1bit") (one warm-up step, buckets of 1001 numbers) on a tiny
  GPT, one process, float64 and float32, against the package's own run.
- 10.5 powersgd_step(comm, M, Q), under mpirun on a counting communicator that refuses
  MPI's collectives: matrices of several shapes, ranks r from 1 to full (r = m, where
  approx is the exact average of M over the ranks), float32 and float64, on the world
  and again on groups of N-1 ranks and of 1 (so at -n 3 on 3, 2 and 1 ranks). The bytes
  this rank sends must be exactly two of minidist.comm's ring all-reduces, of P (n x r)
  and of Q_new (m x r), as minidist.comm.stats counts them. Then 3 steps of a tiny GPT
  trained data-parallel on the world with PowerSGD (rank 2) for every weight matrix,
  each matrix through your powersgd_step, against the same run with the package's.
  (CompressedDataParallel batches all matrices into one all-reduce and does not call
  powersgd_step, so the check's run calls it per matrix.)
"""
import contextlib

import numpy as np

from minidist.grader.checks import Exercise, own_session, world_then_groups, yours
from minidist.grader.checks.ex01_collectives import Kept
from minidist.grader.plugin import Run, plugged
from minidist.parallel import compression
from minidist.parallel.strategy import Strategy
from minidist import precision

MIN_RANKS = 3      # at -n 3 the check runs on 3 ranks, then on groups of 2 and of 1
REFUSE = ("use ring_all_reduce(comm, P) from minidist.comm: this exercise sums P and Q with minidist's "
          "own ring")


def _call(session, fn, *args):
    """fn(counting comm, *args): (result, the comm with its counts); a refused call or a
    truncated message is the student's misuse (as in exercise 01's checks)."""
    from mpi4py import MPI
    from minidist.grader.counting import Misuse
    comm = session.counting(REFUSE)
    try:
        out = fn(comm, *args)
    except MPI.Exception as e:
        if e.Get_error_class() not in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
            raise
        raise Misuse(f"rank {comm.Get_rank()} received a message longer than its receive buffer "
                     "(MPI: Message truncated): the ranks disagree on a message's length") from None
    problem = comm.refused or comm.truncated
    if problem:
        raise Misuse(problem)
    return out, comm


def _short(a):
    a = np.asarray(a)
    text = np.array2string(a.reshape(-1)[:6], precision=4, separator=", ", max_line_width=10**6)
    return text[:-1] + ", ...]" if a.size > 6 else text


def _floats(a):
    return np.asarray(a, dtype=np.float64)


def _fresh(got, inputs):
    """True when no array of got shares memory with an input."""
    return not any(isinstance(g, np.ndarray) and isinstance(x, np.ndarray) and np.shares_memory(g, x)
                   for g in got for x in inputs)


class _Earlier:
    """Results of earlier calls with copies: a later call must leave them unchanged."""

    def __init__(self, name):
        self.name, self.kept = name, []

    def add(self, what, arrays):
        arrays = [a for a in arrays if isinstance(a, np.ndarray)]
        self.kept.append((what, arrays, [a.copy() for a in arrays]))

    def look(self, now):
        for what, arrays, copies in self.kept[:-1]:
            if any(a.shape != c.shape or not np.array_equal(a, c, equal_nan=a.dtype.kind == "f")
                   for a, c in zip(arrays, copies)):
                raise AssertionError(f"the result {self.name} returned for {what} changed when it was called "
                                     f"again ({now}): return new arrays on every call, not buffers kept "
                                     "between calls")


# ----------------------------------------------------------------------------- 10.1 unscale_grads

def _grad(seed, shape, dtype, special=None):
    g = np.random.default_rng(seed).standard_normal(shape) * 100.0
    g = g.astype(dtype)
    if special is not None and g.size:
        g.reshape(-1)[g.size // 2] = special
    return g


SHAPES = [(3, 4), (7,), (0,), (2, 3, 5), (1,)]


def _unscale_cases():
    """(grads, scale, what)."""
    for dtype in (np.float32, np.float16, np.float64):
        name = np.dtype(dtype).name
        for scale in (2.0 ** 16, 2.0 ** -3, 1.0):
            grads = [_grad([7, i, int(np.log2(scale)) + 10], s, dtype) for i, s in enumerate(SHAPES)]
            grads.insert(2, None)
            yield grads, scale, f"{name} gradients, scale {scale:g}"
        grads = [_grad([8, i], s, dtype) for i, s in enumerate(SHAPES)]
        yield grads, 3.0, f"{name} gradients, scale 3 (not a power of two)"
    for special, word in ((np.inf, "an inf"), (-np.inf, "a -inf"), (np.nan, "a nan")):
        for dtype in (np.float16, np.float32, np.float64):
            grads = [_grad([9, i], s, dtype, special if i == 3 else None) for i, s in enumerate(SHAPES)]
            yield grads, 2.0 ** 16, f"{np.dtype(dtype).name} gradients with {word} in one of them"
    yield [None, None], 2.0 ** 16, "no gradients at all (every one None)"
    yield [], 2.0 ** 16, "an empty list"


def _exact_power_of_two(scale):
    m, _ = np.frexp(scale)
    return m == 0.5


def _unscale_problem(got, grads, scale, what):
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"{what}: return (grads, found_inf), a list and a bool; got {type(got).__name__}"
    out, found = got
    if type(found) is not bool:
        numpy_bool = isinstance(found, np.bool_)
        return (f"{what}: found_inf must be a bool (True or False), got "
                + (f"numpy.bool_ ({found!r}, what np.any and np.all return): return bool(...), a Python bool; "
                   "code that tests `found_inf is True` never sees a NumPy True" if numpy_bool else
                   f"{type(found).__module__}.{type(found).__name__} ({found!r})" if isinstance(found, np.generic)
                   else f"{type(found).__name__} ({found!r})"))
    want_found = any(g is not None and not np.all(np.isfinite(g)) for g in grads)
    if bool(found) != want_found:
        kinds = [k for g in grads if g is not None for k, f in (("nan", np.isnan), ("inf", np.isinf)) if f(g).any()]
        hint = (" (a nan is not an inf: np.isinf misses it; np.isfinite catches both)" if kinds == ["nan"] else
                "" if want_found else " (every gradient here is finite)")
        return f"{what}: found_inf is {bool(found)}, expected {want_found}{hint}"
    if not isinstance(out, (list, tuple)) or len(out) != len(grads):
        return (f"{what}: return a list of {len(grads)} gradients, got {type(out).__name__}"
                + (f" of {len(out)}" if hasattr(out, "__len__") else ""))
    for i, (o, g) in enumerate(zip(out, grads)):
        if g is None:
            if o is not None:
                return f"{what}: gradient {i} is None (a parameter without a gradient); None stays None"
            continue
        if not isinstance(o, np.ndarray):
            return f"{what}: gradient {i} is a {type(o).__name__}, expected a NumPy array"
        if o.shape != g.shape:
            return f"{what}: gradient {i} has shape {o.shape}, expected {g.shape}"
        if o.dtype != np.float32:
            return (f"{what}: gradient {i} is {o.dtype.name}, the gradients were {g.dtype.name}: return fp32 "
                    "(float32), what the optimizer's fp32 master weights are updated with")
        want = (_floats(g) / scale).astype(np.float32)
        if _exact_power_of_two(scale):
            ok = np.array_equal(o, want, equal_nan=True)
        else:
            fin = np.isfinite(want)
            ok = np.array_equal(np.isfinite(o), fin) and np.array_equal(o[~fin], want[~fin], equal_nan=True) and \
                np.all(np.abs(_floats(o[fin]) - want[fin]) <= 2.5 * np.spacing(np.abs(want[fin])))
        if not ok:
            with np.errstate(all="ignore"):
                bad = ~((o == want) | (np.isnan(o) & np.isnan(want)))
                j = np.unravel_index(np.argmax(bad), g.shape) if bad.any() else ()
                hint = (" (multiplied by the scale: unscaling divides by it)"
                        if np.allclose(o, _floats(g) * scale, equal_nan=True, rtol=1e-3) else
                        " (a power of two divides exactly: any rounding is a mistake)"
                        if _exact_power_of_two(scale) else "")
            return (f"{what}: gradient {i} is {_short(o)}, expected the gradient / {scale:g} = {_short(want)}"
                    + (f" (first difference at {list(map(int, j))}: {o[j]!r} against {want[j]!r})" if j else "")
                    + hint)
    return None


def check_unscale_grads(fn):
    earlier = _Earlier("unscale_grads")
    for grads, scale, what in _unscale_cases():
        before = [None if g is None else g.copy() for g in grads]
        got = yours(fn, grads, scale)
        for i, (g, b) in enumerate(zip(grads, before)):
            if g is not None and (g.dtype != b.dtype or not np.array_equal(g, b, equal_nan=True)):
                raise AssertionError(f"{what}: unscale_grads changed gradient {i} it was given (an in-place "
                                     "division, g /= scale?): return new arrays, the caller's stay as they were")
        problem = _unscale_problem(got, grads, scale, what)
        if problem:
            raise AssertionError(problem)
        if not _fresh(got[0], grads):
            raise AssertionError(f"{what}: a gradient unscale_grads returned is the input array itself (or a view "
                                 "of it): return new arrays")
        earlier.add(what, list(got[0]))
        earlier.look(what)
    _loss_scaling_run("unscale_grads", fn)


# ----------------------------------------------------------------------------- 10.2 update_scale

def referee_update(scale, good, found, growth, backoff, interval):
    if found:
        return scale * backoff, 0
    if good + 1 >= interval:
        return scale * growth, 0
    return scale, good + 1


def _update_problem(got, args, what):
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"{what}: return (scale, good_steps), two numbers; got {type(got).__name__}"
    scale, good = got
    try:
        good_int = int(good)
    except (TypeError, ValueError):
        return f"{what}: good_steps must be an int, got {type(good).__name__}"
    if good_int != good:
        return f"{what}: good_steps must be a whole number, got {good!r}"
    want_scale, want_good = referee_update(*args)
    if not isinstance(scale, (int, float, np.floating, np.integer)) or float(scale) != want_scale \
            or good_int != want_good:
        s, g, found, growth, backoff, interval = args
        hint = ""
        if type(found) is not bool and float(scale) == referee_update(s, g, not found, *args[3:])[0] \
                and good_int == referee_update(s, g, not found, *args[3:])[1]:
            kind = type(found).__name__ if type(found).__module__ == "builtins" else \
                f"{type(found).__module__}.{type(found).__name__}"
            hint = (f" (found_inf was {found!r}, {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a Python "
                    "bool: `found_inf is True` reads it wrong; test its truth, `if found_inf:`)")
        elif found and good_int != 0:
            hint = " (an inf restarts the count of good steps at 0)"
        elif not found and g + 2 == interval and float(scale) == s * growth:
            hint = f" (grown one step early: the scale grows on good step number {interval} in a row, not before)"
        elif not found and g + 1 == interval and float(scale) == s:
            hint = (f" (good step number {interval} in a row grows the scale: the count reaches growth_interval "
                    "with this step)")
        elif not found and float(scale) == s * growth and good_int == 0 and g + 1 != interval:
            hint = " (grown before the interval)"
        elif found and float(scale) != s * backoff:
            hint = f" (an inf multiplies the scale by backoff_factor {backoff:g})"
        return (f"{what}: update_scale(scale={s:g}, good_steps={g}, found_inf={found}, growth_factor={growth:g}, "
                f"backoff_factor={backoff:g}, growth_interval={interval}) returned ({scale!r}, {good!r}), "
                f"expected ({want_scale:g}, {want_good}){hint}")
    return None


def _update_sequences():
    """(what, [args of each call]): each call's scale and count are the referee's from the one before."""
    hand = [
        ("growth at exactly the interval", 2.0 ** 16, 2.0, 0.5, 3, [False, False, False, False, False, False]),
        ("an inf after good steps", 2.0 ** 16, 2.0, 0.5, 4, [False, False, True, False, False, False, False]),
        ("an inf at the step that would grow", 2.0 ** 10, 2.0, 0.5, 3, [False, False, True, False, False, False]),
        ("interval 1: every good step grows", 8.0, 2.0, 0.5, 1, [False, False, True, False]),
        ("infs in a row", 2.0 ** 16, 2.0, 0.5, 2, [True, True, True, False, False]),
        ("other factors", 1024.0, 4.0, 0.25, 2, [False, False, True, False, True, False, False]),
    ]
    for what, s, gr, bo, interval, infs in hand:
        yield what, s, gr, bo, interval, infs
    g = np.random.default_rng(10)
    for interval in (2, 3, 7, 2000):
        for gr, bo in ((2.0, 0.5), (3.0, 0.125)):
            n = 2 * interval + 40 if interval < 2000 else 4100
            infs = list(g.random(n) < (0.15 if interval < 2000 else 0.0007))
            yield f"{n} steps, growth_interval {interval}, factors {gr:g} and {bo:g}", 2.0 ** 16, gr, bo, interval, infs


# found_inf as callers pass it: a Python bool, a NumPy bool (np.any's result, what a
# student's unscale_grads may return), 0 or 1 (a count of ranks that overflowed)
FOUND_KINDS = (bool, np.bool_, int)


def check_update_scale(fn):
    for what, scale, gr, bo, interval, infs in _update_sequences():
        good = 0
        for k, found in enumerate(infs):
            args = (scale, good, FOUND_KINDS[k % len(FOUND_KINDS)](bool(found)), gr, bo, interval)
            got = yours(fn, *args)
            problem = _update_problem(got, args, f"{what}, step {k + 1}")
            if problem:
                raise AssertionError(problem)
            scale, good = referee_update(*args)
    # the defaults: growth_factor 2, backoff_factor 0.5, growth_interval 2000
    scale, good = 2.0 ** 16, 0
    for k in range(2000):
        got = yours(fn, scale, good, False)
        want = referee_update(scale, good, False, 2.0, 0.5, 2000)
        if not (isinstance(got, tuple) and len(got) == 2 and float(got[0]) == want[0] and got[1] == want[1]):
            raise AssertionError(f"called with its defaults, good step {k + 1} of 2000: update_scale({scale:g}, "
                                 f"{good}, False) returned {got!r}, expected {want}: the defaults are "
                                 "growth_factor=2.0, backoff_factor=0.5, growth_interval=2000")
        scale, good = want
    got = yours(fn, 2.0 ** 16, 5, True)
    if not (isinstance(got, tuple) and len(got) == 2 and float(got[0]) == 2.0 ** 15 and got[1] == 0):
        raise AssertionError(f"called with its defaults, an inf: update_scale(65536, 5, True) returned {got!r}, "
                             "expected (32768.0, 0): backoff_factor defaults to 0.5")
    _loss_scaling_run("update_scale", fn)


# ----------------------------------------------------------------------------- 10.1, 10.2 in training

def _tiny(dtype="float32"):
    from minidist.model import GPTConfig
    return GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, dtype=dtype)


FP16_STEPS, FP16_INIT = 8, 2.0 ** 19


def _fp16_run():
    """8 fp16 training steps with the package's GradScaler: (losses, history, weights, masters)."""
    from minidist.model import GPT
    from minidist.precision import GradScaler, MixedPrecision, autocast
    from minidist.train import micro_batches, train_step
    model = GPT(_tiny(), seed=0)
    opt = MixedPrecision(model.configure_optimizers(0.1, 1e-2), model, "fp16")
    scaler = GradScaler(FP16_INIT, 2.0, 0.5, 2)
    g = np.random.default_rng(0)
    losses = []
    with np.errstate(all="ignore"):
        for step in range(FP16_STEPS):
            x, y = g.integers(0, 32, size=(4, 8)), g.integers(0, 32, size=(4, 8))
            with autocast("fp16"):
                loss, _ = train_step(model, opt, micro_batches(x, y, step, 0), 1e-2, 1.0, scaler=scaler)
            losses.append(loss)
    weights = {n: p.data.copy() for n, p in model.named_parameters()}
    masters = [opt.master[id(p)].data.copy() for p in opt.params]
    return losses, list(scaler.history) + [(scaler.scale, scaler.good_steps)], weights, masters


def _loss_scaling_run(name, fn):
    want = _fp16_run()
    with plugged(getattr(precision, name), fn):
        try:
            got = _fp16_run()
        except Exception as e:
            from minidist.grader.referee import said, where
            raise AssertionError(f"fp16 training with your {name} in minidist.precision (GradScaler, "
                                 f"{FP16_STEPS} steps): crashed: {said(e)}{where(e)}") from None
    setting = (f"fp16 training of a tiny GPT with your {name} in minidist.precision's GradScaler "
               f"(init scale 2^19, growth_interval 2, {FP16_STEPS} steps)")
    if got[1] != want[1]:
        k = next(i for i, (a, b) in enumerate(zip(got[1], want[1])) if a != b)
        raise AssertionError(f"{setting}: at step {k + 1} the (scale, found_inf) was {got[1][k]}, the package's "
                             f"run has {want[1][k]}")
    if got[0] != want[0]:
        k = next(i for i, (a, b) in enumerate(zip(got[0], want[0])) if a != b)
        raise AssertionError(f"{setting}: the loss of step {k + 1} is {got[0][k]!r}, the package's run has "
                             f"{want[0][k]!r}")
    for n in want[2]:
        if not np.array_equal(got[2][n], want[2][n]):
            raise AssertionError(f"{setting}: after {FP16_STEPS} steps the weight {n} differs from the package's "
                                 "run (bit for bit: the scale is a power of two, unscaling is exact)")
    if any(not np.array_equal(a, b) for a, b in zip(got[3], want[3])):
        raise AssertionError(f"{setting}: the fp32 master weights differ from the package's run")


# ----------------------------------------------------------------------------- 10.3, 10.4 one bit

def _onebit_inputs(seed, n, dtype, kind):
    g = np.random.default_rng([seed, n])
    x = g.standard_normal(n).astype(dtype)
    if kind == "zero residual":
        r = np.zeros(n, dtype)
    elif kind == "zeros in v":
        r = (g.standard_normal(n) * 2).astype(dtype)
        hit = g.random(n) < 0.3
        r[hit] = -x[hit]                     # v = x + r is exactly 0 there
    elif kind == "all zero":
        x, r = np.zeros(n, dtype), np.zeros(n, dtype)
    elif kind == "views":
        big_x, big_r = g.standard_normal(n + 9).astype(dtype), (g.standard_normal(n + 9) * 3).astype(dtype)
        x, r = big_x[5:5 + n], big_r[4:4 + n]
    else:                                    # residuals large enough to flip signs
        r = (g.standard_normal(n) * 3 + 0.5).astype(dtype)
    return x, r


NS = (1, 7, 8, 9, 13, 64, 100)
KINDS = ("flipping residual", "zeros in v", "zero residual", "views", "all zero")


def _onebit_cases():
    for dtype in (np.float64, np.float32):
        for kind in KINDS:
            for n in NS:
                x, r = _onebit_inputs(len(kind), n, dtype, kind)
                yield x, r, f"{np.dtype(dtype).name}, n={n}, {kind}"


def _scalar_of(scale, dtype):
    """(the scale as a float, or None; a problem, or None)."""
    a = np.asarray(scale)
    if a.shape != () or a.dtype.kind != "f":
        return None, f"scale must be one number (a NumPy scalar of x's dtype), got {type(scale).__name__} " \
                     f"of shape {a.shape}"
    if a.dtype != dtype:
        return None, f"scale is {a.dtype.name}, x is {np.dtype(dtype).name}: keep x's dtype"
    return float(a), None


def _compress_problem(got, x, r, what):
    dt = x.dtype
    if not (isinstance(got, tuple) and len(got) == 3):
        return f"{what}: return (packed, scale, new_residual); got {type(got).__name__}"
    packed, scale, res = got
    v = x + r
    n = x.size
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8:
        return (f"{what}: packed must be a uint8 array (numpy.packbits), got "
                f"{getattr(packed, 'dtype', type(packed).__name__)}")
    want_packed = np.packbits(v >= 0)
    if packed.shape != want_packed.shape:
        return f"{what}: packed has shape {packed.shape}, expected {want_packed.shape}: ceil(n / 8) bytes, 8 signs each"
    if not np.array_equal(packed, want_packed):
        hint = ("a zero counts as + (v >= 0)" if np.array_equal(packed, np.packbits(v > 0)) else
                "numpy.packbits's default bit order is 'big' (the first sign in the byte's highest bit)"
                if np.array_equal(packed, np.packbits(v >= 0, bitorder="little")) else
                "the signs of v = x + residual: the residual is added first (error feedback)"
                if np.array_equal(packed, np.packbits(x >= 0)) else "the signs of v = x + residual, 1 for >= 0")
        return f"{what}: packed is {_short(packed)}, expected {_short(want_packed)} ({hint})"
    s, problem = _scalar_of(scale, dt)
    if problem:
        return f"{what}: {problem}"
    want_s = float(np.mean(np.abs(_floats(v)))) if n else 0.0
    eps = float(np.finfo(dt).eps)
    if not abs(s - want_s) <= 8 * eps * want_s:
        hint = ("the scale is the mean of |v|, not its max" if abs(s - float(np.max(np.abs(_floats(v))))) <= 8 * eps
                * abs(want_s) + 1e-300 and n > 1 else
                "the mean of |x|: add the residual first" if n and abs(s - float(np.mean(np.abs(_floats(x))))) <=
                8 * eps * want_s else "mean(|x + residual|)")
        return f"{what}: scale is {s!r}, expected {want_s!r} ({hint})"
    if not isinstance(res, np.ndarray):
        return f"{what}: new_residual must be a NumPy array, got {type(res).__name__}"
    if res.shape != x.shape:
        return f"{what}: new_residual has shape {res.shape}, expected {x.shape}"
    if res.dtype != dt:
        return f"{what}: new_residual is {res.dtype.name}, x is {dt.name}: keep x's dtype"
    sent = np.where(v >= 0, s, -s)
    want_res = _floats(v) - sent
    if not np.all(np.abs(_floats(res) - want_res) <= 4 * eps * (np.abs(_floats(v)) + s) + 1e-300):
        hint = ("subtract the decompressed vector (+-scale), not the signs (+-1)"
                if np.allclose(res, _floats(v) - np.where(v >= 0, 1.0, -1.0), atol=1e-5) else
                "it is v - decompress(packed, scale, n), v = x + residual: what this step did not send")
        return f"{what}: new_residual is {_short(res)}, expected {_short(want_res)} ({hint})"
    return None


def check_onebit_compress(fn):
    earlier = _Earlier("onebit_compress")
    for x, r, what in _onebit_cases():
        bx, br = x.copy(), r.copy()
        got = yours(fn, x, r)
        if not np.array_equal(x, bx):
            raise AssertionError(f"{what}: onebit_compress changed x; leave its inputs as they are")
        if not np.array_equal(r, br):
            raise AssertionError(f"{what}: onebit_compress changed the residual it was given (residual += x?): "
                                 "return a new residual, leave the input as it is")
        problem = _compress_problem(got, x, r, what)
        if problem:
            raise AssertionError(problem)
        if not _fresh([got[0], got[2]], [x, r, x.base, r.base]):
            raise AssertionError(f"{what}: new_residual (or packed) shares memory with x or residual: return "
                                 "new arrays")
        earlier.add(what, [got[0], got[2]])
        earlier.look(what)
    _onebit_run("onebit_compress", fn)


def check_onebit_decompress(fn):
    earlier = _Earlier("onebit_decompress")
    for dtype in (np.float64, np.float32):
        for n in NS + (200,):
            g = np.random.default_rng([n, 3])
            bits = g.random(n) < 0.5
            buf = np.concatenate([np.array([7, 9], np.uint8), np.packbits(bits), np.array([255], np.uint8)])
            packed = buf[2:-1]                      # a view into a message, as the package passes it
            before = buf.copy()
            for scale in (dtype(0.375), dtype(g.random() + 0.1), dtype(0)):
                what = f"{np.dtype(dtype).name} scale {float(scale):g}, n={n}"
                got = yours(fn, packed, scale, n)
                if not np.array_equal(buf, before):
                    raise AssertionError(f"{what}: onebit_decompress changed packed; leave its input as it is")
                if not isinstance(got, np.ndarray):
                    raise AssertionError(f"{what}: return a NumPy array, got {type(got).__name__}")
                if got.shape != (n,):
                    raise AssertionError(f"{what}: got shape {got.shape}, expected ({n},): the last byte's unused "
                                         "bits are padding (numpy.unpackbits(..., count=n))")
                if got.dtype != np.dtype(dtype):
                    raise AssertionError(f"{what}: got dtype {got.dtype.name}, scale is {np.dtype(dtype).name}: "
                                         "return scale's dtype")
                want = np.where(bits, scale, -scale).astype(dtype)
                if not np.array_equal(got, want):
                    hint = (" (numpy.unpackbits's default bit order is 'big', as packbits's)"
                            if np.array_equal(got, np.where(np.unpackbits(packed, bitorder="little")[:n].astype(bool),
                                                            scale, -scale)) else
                            " (bit 1 is +scale, bit 0 is -scale)")
                    raise AssertionError(f"{what}: got {_short(got)}, expected {_short(want)}{hint}")
                earlier.add(what, [got])
                earlier.look(what)
    _onebit_run("onebit_decompress", fn)


def _cdp_run(dtype, steps=3):
    """A few steps of CompressedDataParallel("1bit") on a tiny GPT, one process:
    (losses, weights, residuals)."""
    from mpi4py import MPI
    from minidist.model import GPT
    from minidist.train import micro_batches, train_step
    comm = MPI.COMM_SELF.Dup()
    try:
        model = GPT(_tiny(dtype), seed=0)
        opt = model.configure_optimizers(0.1, 1e-2)
        dp = compression.CompressedDataParallel(model, comm, "1bit", warmup_steps=1,
                                                bucket_bytes=1001 * np.dtype(dtype).itemsize)
        g = np.random.default_rng(1)
        losses = []
        for step in range(steps):
            x, y = g.integers(0, 32, size=(2, 8)), g.integers(0, 32, size=(2, 8))
            loss, _ = train_step(model, opt, micro_batches(x, y, step, 0), 1e-2, 1.0, dp=dp)
            losses.append(loss)
    finally:
        comm.Free()
    return (losses, {n: p.data.copy() for n, p in model.named_parameters()},
            [dp.worker_error.copy()] + [e.copy() for e in dp.server_error])


def _onebit_run(name, fn):
    for dtype in ("float64", "float32"):
        tol = 1e-9 if dtype == "float64" else 2e-4
        want = _cdp_run(dtype)
        setting = (f"3 steps of CompressedDataParallel(\"1bit\", warmup_steps=1, buckets of 1001 numbers) on a "
                   f"tiny GPT in {dtype}, with your {name} in minidist.parallel.compression")
        with plugged(getattr(compression, name), fn):
            try:
                got = _cdp_run(dtype)
            except Exception as e:
                from minidist.grader.referee import said, where
                raise AssertionError(f"{setting}: crashed: {said(e)}{where(e)}") from None
        for k, (a, b) in enumerate(zip(got[0], want[0])):
            if not abs(a - b) <= tol * max(1.0, abs(b)):
                raise AssertionError(f"{setting}: the loss of step {k + 1} is {a!r}, the package's run has {b!r}")
        for n in want[1]:
            if got[1][n].dtype != want[1][n].dtype or not _close(got[1][n], want[1][n], tol):
                raise AssertionError(f"{setting}: the weight {n} differs from the package's run")
        if any(a.dtype != b.dtype or not _close(a, b, tol) for a, b in zip(got[2], want[2])):
            raise AssertionError(f"{setting}: the error-feedback residuals differ from the package's run")


def _close(a, b, tol):
    a, b = _floats(a), _floats(b)
    return a.shape == b.shape and (b.size == 0 or
                                   float(np.max(np.abs(a - b))) <= tol * max(1.0, float(np.max(np.abs(b)))))


# ----------------------------------------------------------------------------- 10.5 powersgd_step

def referee_orthogonalize(P):
    """Gram-Schmidt in float64, each column twice against the ones before, then normalised."""
    P = _floats(P).copy()
    for i in range(P.shape[1]):
        for _ in range(2):
            for j in range(i):
                P[:, i] -= (P[:, j] @ P[:, i]) * P[:, j]
        P[:, i] /= np.linalg.norm(P[:, i])
    return P


def _matrices(seed, n, m, r, ranks, dtype):
    Ms = [np.random.default_rng([seed, k, n, m]).standard_normal((n, m)).astype(dtype) for k in ranks]
    Q = np.random.default_rng([seed, 99, m, r]).standard_normal((m, r)).astype(dtype)
    return Ms, Q


# (3000, 6, 4): P is 3000 x 4 numbers, 96 KB in float64, past MPI's eager limit (about 64 KB):
# a hand-written exchange that sends before it receives deadlocks there, not at the small sizes
PSGD_CASES = [(6, 4, 1), (7, 5, 2), (5, 3, 3), (4, 9, 2), (9, 4, 4), (1, 5, 1), (3000, 6, 4), (7, 5, 2)]


def _powersgd_cases(fn, s, members, seed=11):
    from minidist.comm import stats
    N, me = s.size(), s.rank()
    kept = Kept("powersgd_step", members[me])
    for dtype in (np.float64, np.float32):
        for c, (n, m, r) in enumerate(PSGD_CASES):
            what = f"{np.dtype(dtype).name} M {n} x {m}, Q {m} x {r}" + (" (full rank)" if r == m else "") \
                + (", other values" if c == len(PSGD_CASES) - 1 else "")
            where = f"rank {members[me]}, {what}"
            M = _matrices(seed + c, n, m, r, [members[me]], dtype)[0][0]
            Q = _matrices(seed + c, n, m, r, [], dtype)[1]
            bM, bQ = M.copy(), Q.copy()
            with stats.measure() as meas:
                got, comm = _call(s, fn, M, Q)
            if not np.array_equal(M, bM):
                raise AssertionError(f"{where}: powersgd_step changed M (M += ..., or an in-place write into a "
                                     "view of it); leave its inputs as they are")
            if not np.array_equal(Q, bQ):
                raise AssertionError(f"{where}: powersgd_step changed Q; return Q_new as a new array")
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"{where}: return (approx, Q_new), got {type(got).__name__}")
            approx, Q_new = got
            for label, a, shape in (("approx", approx, (n, m)), ("Q_new", Q_new, (m, r))):
                if not isinstance(a, np.ndarray):
                    raise AssertionError(f"{where}: {label} must be a NumPy array, got {type(a).__name__}")
                if a.shape != shape:
                    raise AssertionError(f"{where}: {label} has shape {a.shape}, expected {shape}")
                if a.dtype != np.dtype(dtype):
                    raise AssertionError(f"{where}: {label} is {a.dtype.name}, M is {np.dtype(dtype).name}: keep "
                                         "M's dtype (a wider one also sends more bytes)")
            if not _fresh([approx, Q_new], [M, Q]):
                raise AssertionError(f"{where}: approx or Q_new shares memory with M or Q: return new arrays")
            item = np.dtype(dtype).itemsize
            want_bytes = compression.ring_bytes(n * r, N, me, item) + compression.ring_bytes(m * r, N, me, item)
            ring = meas.bytes_sent("all_reduce")
            if ring != want_bytes or comm.bytes_sent != want_bytes:
                mb = compression.ring_bytes(n * m, N, me, item)
                hint = ("the bytes of a ring all-reduce of M itself: all-reduce P = M Q (n x r) and Q_new = M^T P "
                        "(m x r), which are what PowerSGD sends" if ring in (mb, mb + compression.ring_bytes(
                            m * r, N, me, item), mb + compression.ring_bytes(n * r, N, me, item)) else
                        "sum with minidist.comm's ring_all_reduce: minidist.comm.stats counts nothing else"
                        if ring == 0 and comm.bytes_sent else
                        "two ring all-reduces, of P and of Q_new, nothing else")
                raise AssertionError(f"{where}: sent {comm.bytes_sent} bytes, {ring} of them in minidist.comm's "
                                     f"ring all-reduce; PowerSGD sends {want_bytes} (ring all-reduces of "
                                     f"{n} x {r} and {m} x {r} numbers) ({hint})")
            kept.add(what, approx)
            kept.add(what + " (Q_new)", Q_new)
            kept.look(what)
            # the answer, only now: every rank's M, in float64
            Ms, _ = _matrices(seed + c, n, m, r, members, dtype)
            S = sum(_floats(x) for x in Ms)
            P = referee_orthogonalize(S @ _floats(Q))
            want_Q = S.T @ P
            want = P @ want_Q.T / N
            tol = 1e-9 if dtype == np.float64 else 2e-4
            for label, a, w in (("Q_new", Q_new, want_Q), ("approx", approx, want)):
                if _close(a, w, tol):
                    continue
                raw = S @ _floats(Q)
                hint = ("the approximation summed, not averaged: divide by N = comm.Get_size()"
                        if label == "approx" and N > 1 and _close(a, want * N, tol) else
                        "P is orthogonalized after its all-reduce (Gram-Schmidt: orthogonalize(P))"
                        if _close(a, (S.T @ raw) if label == "Q_new" else raw @ (S.T @ raw).T / N, tol) else
                        "np.linalg.qr may flip a column's sign: Gram-Schmidt keeps each column's direction"
                        if label == "Q_new" and _close(np.abs(_floats(a)), np.abs(w), tol) else
                        "P = M Q summed over ranks, orthogonalized; Q_new = M^T P summed over ranks; "
                        "approx = P Q_new^T / N")
                if r == m and label == "approx":
                    hint += "; at full rank approx is the exact average of M over the ranks"
                raise AssertionError(f"{where}: {label} is {_short(a)}, expected {_short(w)} ({hint})")
    kept.report()


def check_powersgd_step(fn, session=None):
    with own_session(session, split=True) as world:
        world_then_groups(world, lambda s: _powersgd_cases(fn, s, _members(s, world)))
        _powersgd_run(fn, world)


def _members(s, world):
    return list(range(s.size())) if s is world else list(world.group)


class _PowerSGD(Strategy):
    """A dp slot for train_step: every weight matrix through step_fn (PowerSGD with error
    feedback, rank 2), the vectors averaged with the ring."""

    def __init__(self, model, s, step_fn):
        self.s, self.step_fn = s, step_fn
        self.params = [p for _, p in model.named_parameters()]
        g = np.random.default_rng(5)
        self.Q, self.err = {}, {}
        for i, p in enumerate(self.params):
            if p.data.ndim >= 2:
                n, m = p.data.shape[0], p.data.size // p.data.shape[0]
                self.Q[i] = g.standard_normal((m, min(2, n, m))).astype(p.data.dtype)
                self.err[i] = np.zeros((n, m), p.data.dtype)

    def backward_context(self, last):
        return contextlib.nullcontext()

    def sync(self):
        from minidist.comm import ring_all_reduce
        N = self.s.size()
        for i, p in enumerate(self.params):
            g = np.asarray(p.grad)
            if i in self.Q:
                M = g.reshape(self.err[i].shape) + self.err[i]
                approx, self.Q[i] = _call(self.s, self.step_fn, M, self.Q[i])[0]
                self.err[i] = M - approx
                p.grad = np.asarray(approx).reshape(g.shape)
            else:
                p.grad = ring_all_reduce(self.s.counting(REFUSE), g) / N


def _psgd_train(s, step_fn, steps=3):
    from minidist.model import GPT
    from minidist.train import micro_batches, train_step
    model = GPT(_tiny("float64"), seed=0)
    opt = model.configure_optimizers(0.1, 1e-2)
    dp = _PowerSGD(model, s, step_fn)
    N, me = s.size(), s.rank()
    g = np.random.default_rng(2)
    losses = []
    for step in range(steps):
        x, y = g.integers(0, 32, size=(2 * N, 8)), g.integers(0, 32, size=(2 * N, 8))
        rows = slice(2 * me, 2 * me + 2)
        loss, _ = train_step(model, opt, micro_batches(x[rows], y[rows], step, 0, 1, 2 * me), 1e-2, 1.0, dp=dp)
        losses.append(loss)
    return losses, {n: p.data.copy() for n, p in model.named_parameters()}


def _powersgd_run(fn, s):
    want = _psgd_train(s, compression.powersgd_step)
    setting = (f"3 steps of data-parallel training of a tiny GPT in float64 on {s.size()} ranks, every weight "
               "matrix through your powersgd_step (rank 2, error feedback)")
    try:
        got = _psgd_train(s, fn)
    except AssertionError:
        raise
    except Exception as e:
        from minidist.grader.referee import said, where
        raise AssertionError(f"{setting}: rank {s.rank()} crashed: {said(e)}{where(e)}") from None
    for k, (a, b) in enumerate(zip(got[0], want[0])):
        if not abs(a - b) <= 1e-8 * max(1.0, abs(b)):
            raise AssertionError(f"{setting}: rank {s.rank()}'s loss of step {k + 1} is {a!r}, the package's run "
                                 f"has {b!r}")
    for n in want[1]:
        if not _close(got[1][n], want[1][n], 1e-8):
            raise AssertionError(f"{setting}: rank {s.rank()}'s weight {n} differs from the package's run")


# ----------------------------------------------------------------------------- the exercises

# The plug-in check (minidist/grader/plugin.py) runs lesson 10 with the function plugged in:
# the lesson's exact checks call unscale_grads (loss scaling, bit for bit), onebit_compress
# and onebit_decompress (the error-feedback identity) and powersgd_step (full rank equals
# the exact average), and its fp16 and 1-bit runs train through them; a wrong answer that
# breaks any of these makes the lesson fail, and the exercise with it.
LESSON = "10_precision_and_compression"


def tiny(*flags):
    """A setting of lesson 10 small enough to run in seconds on any number of ranks n
    (a global batch of 2 sequences per rank)."""
    return lambda n: ("--n-layer", "1", "--n-embd", "16", "--block-size", "8", "--batch-size", str(2 * n),
                      "--steps", "4", "--eval-iters", "1", "--eval-interval", "4", *flags)


def fp16_figures(report):
    """What the fp16 run did, beside the package's own run: a scale that never backs off
    skips every step and trains nothing, and lesson 10's MATCH (its exact checks) still holds."""
    fp16 = next(v for v in report["variants"] if v["precision"] == "fp16")
    return {"fp16 variant's skipped steps": fp16["skipped_steps"], "fp16 variant's val loss": fp16["val_loss"]}


FP16_RUNS = (Run(LESSON, tiny("--precision", "fp16", "--init-scale", str(2 ** 19), "--growth-interval", "2"),
                 ranks=1, figures=fp16_figures, together=True),)
ONEBIT_RUNS = (Run(LESSON, tiny("--compressor", "1bit", "--warmup-steps", "1"), ranks=1, together=True),)
POWERSGD_RUNS = (Run(LESSON, tiny("--compressor", "powersgd", "--rank", "2")),)

EXERCISES = [
    Exercise("10.1", "unscale_grads", precision.unscale_grads, check_unscale_grads, runs=FP16_RUNS),
    Exercise("10.2", "update_scale", precision.update_scale, check_update_scale, runs=FP16_RUNS),
    Exercise("10.3", "onebit_compress", compression.onebit_compress, check_onebit_compress, runs=ONEBIT_RUNS),
    Exercise("10.4", "onebit_decompress", compression.onebit_decompress, check_onebit_decompress, runs=ONEBIT_RUNS),
    Exercise("10.5", "powersgd_step", compression.powersgd_step, check_powersgd_step, MIN_RANKS, groups=True,
             why_ranks="at -n 3 the check runs on the world and on groups of 2 ranks and of 1, so the sum over "
                       "ranks, the division by N and the ring's uneven chunks are all seen;", runs=POWERSGD_RUNS),
]
