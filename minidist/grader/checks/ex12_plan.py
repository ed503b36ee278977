"""Checks for lessons/exercises/12_plan.py: ZeRO's memory per device, the pipeline's bubble
and micro-batches in flight, and the fastest layout under a memory cap.

Each function is compared with a referee written here again, as plainly as the rule
reads, in exact arithmetic (fractions.Fraction), on many inputs and only after the
student's function has returned:

- 12.1 model_state_bytes(psi, n_d, stage, accounting): Psi from 1 to 1e12 (7.5e9 and 70e9
  among them, ints and floats), n_d 1 to 16384 (1: every stage the same), stages 0-3,
  the three named accountings and tuples. Each value within 1e-12 of the exact one
  (float64 rounds in the 16th digit; float32, which cannot hold 70e9 x 16 to the byte,
  is off in the 8th), Python numbers (not numpy's), the three keys exactly; a stage
  outside 0-3 and an unknown accounting name raise ValueError.
- 12.2 bubble_fraction(schedule, p, m, v, costs): the five schedules, p 1-8, m 1-12 and
  64 (m < p included), v 1-4 for interleaving (m a multiple of p), zb-h1 at several
  costs. Exact: a Fraction (or an int 0), equal to the referee's; where a schedule can be
  built (minidist.parallel.schedules), also equal to its simulation's idle fraction,
  which needs no referee. An unknown schedule raises ValueError.
- 12.3 in_flight(p, m, v): p 1-8, m 1-16 (m < p included), v 1-4 with m a multiple of p;
  exact, and equal to the simulated 1F1B or interleaved schedule's peak of live
  (micro-batch, chunk) pairs on the first stage, divided by v.
- 12.4 choose(estimates, cap_bytes): the empty list, nothing that fits, a layout needing
  exactly the cap (it fits) and one byte more (it does not), the fastest not fitting,
  the one with the most memory left being slower, ties in step time (the first listed
  wins), memory in ints and floats, and 300 random lists. The object returned must be
  one of the list's (not a copy, not an index), None when nothing fits, and the list
  unchanged.

Then the plug-in check runs lesson 12, a 7B model on 16 GPUs, with the function in the package
(python -m minidist.lessons.12_plan --gpus 16 --params 7e9): the ZeRO paper's 7.5B-on-64 figures
(120, 31.4, 16.6, 1.9 GB in its Figure 1) reproduced, a pipelined layout's bubble and first-stage
micro-batches in flight equal to its simulated schedule, and the chosen layouts fitting
with nothing that fits faster. One process, so the grader grades this file serially.
"""
import math
import numbers
from fractions import Fraction

import numpy as np

from minidist.grader.checks import Exercise, yours
from minidist.grader.plugin import Run
from minidist.grader.referee import said, where
from minidist.plan import choose as choosing
from minidist.plan import memory, pipeline

# ----------------------------------------------------------------------------- referees

NAMED = {"zero": (2, 2, 12), "megatron": (2, 4, 12), "fp32": (4, 4, 8)}


def referee_states(psi, n_d, stage, accounting):
    """{category: exact bytes per device} as the paper's section 3 reads."""
    w, g, k = NAMED[accounting] if isinstance(accounting, str) else accounting
    whole, cut = Fraction(psi), Fraction(psi) / n_d
    return {"weights": w * (cut if stage >= 3 else whole),
            "grads": g * (cut if stage >= 2 else whole),
            "optimizer": k * (cut if stage >= 1 else whole)}


def referee_bubble(schedule, p, m, v, costs):
    f, b, w = (Fraction(c) for c in costs)
    if schedule == "naive":
        return Fraction(p - 1, p)
    if schedule in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if schedule == "interleaved":
        return Fraction(p - 1, v * m + p - 1)
    idle = (p - 1) * (f + (b - w) - w)
    return idle / (m * (f + b) + idle)


def referee_in_flight(p, m, v):
    if v == 1:
        return Fraction(min(p, m))
    return Fraction(min(v * m, v * p + p - 1), v)


def simulated(schedule, p, m, v=1, costs=(1, 2, 1)):
    """(bubble, first stage's peak in micro-batches) of the schedule run in logical time, or
    None where minidist.parallel.schedules cannot build it."""
    from minidist.parallel import schedules
    try:
        sim = schedules.simulate(schedules.build(schedule, p, m, v), p, m, v, costs)
    except schedules.ScheduleError:
        return None
    return sim.bubble, Fraction(sim.peak[0], v)


# ----------------------------------------------------------------------------- shared

def _plain_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, (bool, np.generic))


def _close(got, want, rel=1e-12):
    return math.isfinite(got) and abs(Fraction(got) - want) <= rel * abs(want)


def _g(x):
    """A number of bytes as a class reads it: whole ones with commas, others in full."""
    x = float(x)
    return f"{int(x):,}" if x.is_integer() and abs(x) < 1e18 else repr(x)


def _call(fn, name, *args):
    """fn(*args), a crash of the student's code said in one line with its place."""
    try:
        return yours(fn, *args)
    except AssertionError:
        raise
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(f"{name}{args!r} raised {said(e)}{where(e)}") from None


def _must_raise(fn, name, args, why):
    try:
        fn(*args)
    except ValueError:
        return
    except AssertionError as e:
        raise AssertionError(f"{name}{args!r}: your code's assert failed{': ' + str(e) if str(e) else ''}"
                             f"{where(e)}; {why} is a ValueError (raise ValueError(...), not assert)") from None
    except Exception as e:
        raise AssertionError(f"{name}{args!r} raised {said(e)}{where(e)}; {why} is a ValueError") from None
    raise AssertionError(f"{name}{args!r} returned instead of raising ValueError: {why} is an error")


# ----------------------------------------------------------------------------- 12.1 model_state_bytes

PSIS = [1, 3, 1000, 123_456_789, 7.5e9, 70e9, 70_000_000_000, 175e9, 1e12]
N_DS = [1, 2, 3, 7, 16, 64, 1024, 16384]
ACCOUNTINGS = ["zero", "megatron", "fp32", (2, 4, 12), (4, 0, 8), (1, 3, 5)]


def _states_hint(got, psi, n_d, stage, acc):
    """A sentence for a known slip, or ''."""
    w, g, k = NAMED[acc] if isinstance(acc, str) else acc
    whole, cut = Fraction(psi), Fraction(psi) / n_d
    gw, gg, go = (Fraction(got[c]) if _plain_number(got[c]) and math.isfinite(got[c]) else None
                  for c in ("weights", "grads", "optimizer"))
    if stage == 2 and gg is not None and _close(float(gg), g * whole) and n_d > 1:
        return " (stage 2 cuts the gradients too: each device keeps the reduced 1/n_d it owns, g Psi / n_d)"
    if stage == 3 and gw is not None and _close(float(gw), w * whole) and n_d > 1:
        return " (stage 3 cuts the weights too: w Psi / n_d per device, gathered only while a layer computes)"
    if stage == 1 and gg is not None and _close(float(gg), g * cut) and n_d > 1:
        return " (stage 1 cuts the optimizer state only: the gradients stay whole, g Psi)"
    if stage >= 1 and go is not None and _close(float(go), k * whole) and n_d > 1:
        return f" (stage {stage} cuts the optimizer state: k Psi / n_d)"
    if stage == 0 and any(x is not None and _close(float(x), c * cut) for x, c in ((gw, w), (gg, g), (go, k))) \
            and n_d > 1:
        return " (stage 0 is plain data parallelism: every device keeps all three whole)"
    if acc != "zero":
        zero = referee_states(psi, n_d, stage, "zero").values()
        if all(x is not None for x in (gw, gg, go)) and all(_close(float(x), y) for x, y in zip((gw, gg, go), zero)):
            return f" (that is the ZeRO paper's 2 + 2 + 12: this call's accounting is {acc!r}, {(w, g, k)})"
    rel = max((abs(Fraction(x) - y) / y for x, y in zip((gw, gg, go), referee_states(psi, n_d, stage, acc).values())
               if x is not None and y), default=0)
    if 1e-12 < rel < 1e-6:
        return (f" (off by {float(rel):.1e} of the value: float32's rounding; compute in Python numbers or "
                "float64, which hold 70e9 x 16 exactly)")
    return ""


def check_model_state_bytes(fn):
    for psi in PSIS:
        for n_d in N_DS:
            for stage in range(4):
                for acc in ACCOUNTINGS:
                    call = f"model_state_bytes({psi!r}, {n_d}, {stage}, {acc!r})"
                    got = _call(fn, "model_state_bytes", psi, n_d, stage, acc)
                    _states_ok(got, psi, n_d, stage, acc, call)
    for args, why in (((7.5e9, 64, 4), "stage 4"), ((7.5e9, 64, -1), "stage -1"),
                      ((7.5e9, 64, 1, "bf16"), "the accounting 'bf16' (not one of zero, megatron, fp32)")):
        _must_raise(fn, "model_state_bytes", args, why)


def _states_ok(got, psi, n_d, stage, acc, call):
    want = referee_states(psi, n_d, stage, acc)
    if not isinstance(got, dict):
        raise AssertionError(f"{call} returned {type(got).__name__} {got!r}; return a dict "
                             "{'weights': ..., 'grads': ..., 'optimizer': ...}")
    if set(got) != set(want):
        raise AssertionError(f"{call} returned the keys {sorted(map(str, got))}; the keys are exactly "
                             "'weights', 'grads' and 'optimizer'")
    for cat in ("weights", "grads", "optimizer"):
        v = got[cat]
        if not _plain_number(v):
            kind = f"{type(v).__module__}.{type(v).__name__}" if isinstance(v, np.generic) else type(v).__name__
            raise AssertionError(f"{call}[{cat!r}] is a {kind} ({v!r}): return a Python int or float "
                                 + ("(float32 cannot hold 70e9 x 16 to the byte; float(...) of a numpy number)"
                                    if isinstance(v, np.generic) else "(a number of bytes)"))
    bad = [c for c in ("weights", "grads", "optimizer") if not _close(got[c], want[c])]
    if bad:
        c = bad[0]
        raise AssertionError(f"{call}[{c!r}] = {_g(got[c])} bytes, expected {_g(want[c])}"
                             f"{_states_hint(got, psi, n_d, stage, acc)}")


# ----------------------------------------------------------------------------- 12.2 bubble_fraction

def _bubble_cases():
    """(schedule, p, m, v, costs)."""
    ms = list(range(1, 13)) + [64]
    for p in range(1, 9):
        for m in ms:
            for name in ("naive", "gpipe", "1f1b"):
                yield name, p, m, 1, (1, 2, 1)
            yield "interleaved", p, m, 1, (1, 2, 1)
            for v in (2, 3, 4):
                if m % p == 0:
                    yield "interleaved", p, m, v, (1, 2, 1)
            for costs in ((1, 2, 1), (1, 1, 0), (2, 3, 1), (1, 2, 0)):
                yield "zb-h1", p, m, 1, costs


def _bubble_hint(got, name, p, m, v, costs):
    if got == Fraction(p - 1, m) and name != "naive":
        return (" ((p-1)/m is the bubble beside the ideal compute time m; of the TOTAL time, idle plus "
                "compute, it is (p-1)/(m+p-1))")
    if name == "interleaved" and v > 1 and got == Fraction(p - 1, m + p - 1):
        return f" (the {v} chunks per stage: v m + p - 1 below, not m + p - 1)"
    if name == "interleaved" and v > 1 and got == Fraction(p - 1, v * m):
        return " ((p-1)/(v m) is beside the ideal compute time; of the total: (p-1)/(v m + p - 1))"
    return ""


def check_bubble_fraction(fn):
    for name, p, m, v, costs in _bubble_cases():
        call = f"bubble_fraction({name!r}, p={p}, m={m}, v={v}, costs={costs})"
        got = _call(fn, "bubble_fraction", name, p, m, v, costs)
        want = referee_bubble(name, p, m, v, costs)
        _exact_ok(got, want, call)
        if got != want:
            raise AssertionError(f"{call} = {got}, expected {want}{_bubble_hint(got, name, p, m, v, costs)}")
        if p <= 4 and m <= 8 and costs == (1, 2, 1) and not (name == "zb-h1" and m < p):
            sim = simulated(name, p, m, v, costs)       # (zb-h1's formula holds for m >= p)
            if sim is not None and sim[0] != got:
                raise AssertionError(f"{call} = {got}, but the schedule run in logical time "
                                     f"(minidist.parallel.schedules.simulate) idles {sim[0]} of its time")
    for args in (("zb-h2", 4, 8), ("1F1B", 4, 8), ("pipedream", 2, 2)):
        _must_raise(fn, "bubble_fraction", args, f"the unknown schedule {args[0]!r}")


def _exact_ok(got, want, call):
    """got a Fraction or an int, equal to want; else a sentence."""
    if isinstance(got, bool) or not isinstance(got, (Fraction, int)):
        close = isinstance(got, numbers.Real) and math.isfinite(float(got)) and abs(float(got) - want) < 1e-9
        raise AssertionError(f"{call} returned {got!r} ({type(got).__name__}); return a fractions.Fraction"
                             + (f" (exactly {want}: a float rounds it)" if close else "") +
                             " (Fraction(a, b) of whole numbers, or Fraction(x) of one)")


# ----------------------------------------------------------------------------- 12.3 in_flight

def _flight_cases():
    for p in range(1, 9):
        for m in range(1, 17):
            yield p, m, 1
            for v in (2, 3, 4):
                if m % p == 0:
                    yield p, m, v


def _flight_hint(got, p, m, v):
    if v == 1 and got == m and m > p:
        return (f" (m = {m}: the warm-up runs one forward per stage before the first backward frees one, so "
                f"at most p = {p} are held: min(p, m))")
    if v == 1 and got == p and m < p:
        return f" (only m = {m} micro-batches exist: min(p, m))"
    if v > 1 and got == p:
        return (" (interleaved, the first stage's warm-up is v p + p - 1 chunk forwards, each 1/v of its layers: "
                "p + (p-1)/v micro-batches, capped at m)")
    if v > 1 and got in (Fraction(v * p + p - 1), p + (p - 1) * v, p + Fraction(p - 1, p * v)):
        return " (count chunks as 1/v of a micro-batch: (v p + p - 1)/v)"
    return ""


def check_in_flight(fn):
    for p, m, v in _flight_cases():
        call = f"in_flight(p={p}, m={m}, v={v})"
        got = _call(fn, "in_flight", p, m, v)
        want = referee_in_flight(p, m, v)
        _exact_ok(got, want, call)
        if got != want:
            raise AssertionError(f"{call} = {got}, expected {want}{_flight_hint(got, p, m, v)}")
        if p <= 4 and m <= 12:
            sim = simulated("1f1b" if v == 1 else "interleaved", p, m, v)
            if sim is not None and sim[1] != got:
                raise AssertionError(f"{call} = {got}, but the schedule run in logical time holds {sim[1]} "
                                     "micro-batches on its first stage at the peak")


# ----------------------------------------------------------------------------- 12.4 choose

class Est:
    """What choose reads of a minidist.plan.cost Estimate."""

    def __init__(self, name, step_time_s, memory_bytes_per_gpu):
        self.name, self.step_time_s, self.memory_bytes_per_gpu = name, step_time_s, memory_bytes_per_gpu

    def __repr__(self):
        return f"{self.name} ({self.step_time_s:g} s, {_g(self.memory_bytes_per_gpu)} B)"


def referee_choose(estimates, cap):
    fits = [e for e in estimates if e.memory_bytes_per_gpu <= cap]
    if not fits:
        return None
    best = min(e.step_time_s for e in fits)
    return next(e for e in fits if e.step_time_s == best)


GB = 10 ** 9


def _choose_cases():
    """(estimates, cap, what)."""
    E = Est
    yield [], 80 * GB, "an empty list"
    yield [E("A", 2.0, 90 * GB), E("B", 1.0, 81 * GB)], 80 * GB, "nothing fits"
    yield [E("A", 1.0, 80 * GB), E("B", 2.0, 10 * GB), E("C", 1.5, 60 * GB)], 80 * GB, \
        "the fastest needs exactly the cap (it fits)"
    yield [E("A", 1.0, 80 * GB + 1), E("B", 2.0, 10 * GB)], 80 * GB, "the fastest needs one byte over the cap"
    yield [E("A", 1.0, 100 * GB), E("B", 3.0, 70 * GB), E("C", 2.0, 75 * GB)], 80 * GB, \
        "the fastest does not fit; of the others, not the first listed"
    yield [E("A", 3.0, 5 * GB), E("B", 1.5, 60 * GB), E("C", 2.0, 40 * GB)], 80 * GB, \
        "the one with the most memory left is the slowest"
    yield [E("A", 2.0, 70 * GB), E("B", 1.0, 50 * GB), E("C", 1.0, 20 * GB)], 80 * GB, \
        "a tie in step time (the first listed wins)"
    yield [E("A", 1.0, 79.5e9), E("B", 1.0, 20e9)], 79.5e9, "a tie, memory in floats, the first exactly at the cap"
    yield [E("A", 1.25, 40 * GB)], 40 * GB, "one estimate, exactly at the cap"
    yield [E("A", 1.0, 0.0)], 0, "a cap of 0 and an estimate needing nothing"
    g = np.random.default_rng(1212)
    for k in range(300):
        n = int(g.integers(1, 12))
        times = g.choice([0.5, 1.0, 1.5, 2.0, 2.5, 3.0], size=n) if k % 3 == 0 else g.uniform(0.1, 10, size=n)
        mems = g.integers(1, 200, size=n) * GB if k % 2 else g.uniform(1e9, 2e11, size=n)
        ests = [E(chr(65 + i), float(t), int(mm) if k % 2 else float(mm)) for i, (t, mm) in enumerate(zip(times, mems))]
        cap = ests[int(g.integers(0, n))].memory_bytes_per_gpu if k % 4 == 0 else float(g.uniform(1e9, 2e11))
        yield ests, cap, f"random list {k}"


def _choose_hint(got, want, ests, cap):
    if got is not None and got.memory_bytes_per_gpu > cap:
        return " (it does not fit: memory_bytes_per_gpu must be at most the cap)"
    below = [e for e in ests if e.memory_bytes_per_gpu < cap]
    if want is not None and want.memory_bytes_per_gpu == cap and got is referee_choose(below, cap):
        return " (a layout needing exactly the cap fits: at most, <=, not <)"
    fits = [e for e in ests if e.memory_bytes_per_gpu <= cap]
    if got is not None and got in fits and got.step_time_s == want.step_time_s:
        return " (a tie in step time: the one earlier in the list)"
    if got is not None and fits and got is max(fits, key=lambda e: cap - e.memory_bytes_per_gpu):
        return " (the most memory left is not the goal: the shortest step time among those that fit)"
    if got is None and want is not None:
        return " (something fits: return it; None only when nothing does)"
    return ""


def check_choose(fn):
    for ests, cap, what in _choose_cases():
        before = [(id(e), e.step_time_s, e.memory_bytes_per_gpu) for e in ests]
        given = list(ests)
        call = f"choose({ests!r}, {_g(cap)}) ({what})"
        got = _call(fn, "choose", given, cap)
        if [(id(e), e.step_time_s, e.memory_bytes_per_gpu) for e in given] != before:
            raise AssertionError(f"{call}: the list changed: leave it as it was (sorted(...) makes a new list; "
                                 ".sort() reorders the caller's)")
        want = referee_choose(ests, cap)
        if got is not None and not any(got is e for e in ests):
            kind = "an index" if isinstance(got, (int, np.integer)) else type(got).__name__
            raise AssertionError(f"{call} returned {got!r} ({kind}); return the estimate itself, one of the list's "
                                 "objects (or None)")
        if got is not want:
            raise AssertionError(f"{call} returned {got!r}, expected {want!r}{_choose_hint(got, want, ests, cap)}")


# ----------------------------------------------------------------------------- the exercises

def _judge(key):
    """The lesson's own verdict on what the exercise's function feeds (its report's checks)."""
    return lambda report: bool(((report.get("figures") or {}).get("checks") or {}).get(key))


# Lesson 12, 7B on 16 GPUs (a small search; every section prints): its own checks hold
# the ZeRO memory to the paper's figures (12.1), the best layout's bubble and first-stage
# micro-batches in flight to its simulated schedule (12.2, 12.3), and each chosen layout to
# the rule (12.4). The published table runs too; its verdict is the cost model's, not the
# exercise's, and is not judged here. No --dtype: the planner computes in Python numbers.
FLAGS = ("--gpus", "16", "--params", "7e9", "--no-published")


def _run(key):
    return (Run("12_plan", FLAGS, ranks=1, dtypes=(None,), judge=_judge(key)),)


EXERCISES = [
    Exercise("12.1", "model_state_bytes", memory.model_state_bytes, check_model_state_bytes,
             runs=_run("zero_paper")),
    Exercise("12.2", "bubble_fraction", pipeline.bubble_fraction, check_bubble_fraction, runs=_run("bubble")),
    Exercise("12.3", "in_flight", pipeline.in_flight, check_in_flight, runs=_run("in_flight")),
    Exercise("12.4", "choose", choosing.choose, check_choose, runs=_run("choice")),
]
