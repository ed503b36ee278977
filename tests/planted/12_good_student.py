"""A right answer to all four, written as a student would: the grader must PASS it, lesson 12
run with each function plugged into the package included."""
from fractions import Fraction

EXPECT = {"12.1": None, "12.2": None, "12.3": None, "12.4": None}
RANKS = 1

BYTES = {"zero": (2, 2, 12), "megatron": (2, 4, 12), "fp32": (4, 4, 8)}


def model_state_bytes(psi, n_d, stage, accounting="zero"):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"no ZeRO stage {stage}")
    if isinstance(accounting, str):
        if accounting not in BYTES:
            raise ValueError(f"unknown accounting {accounting}")
        accounting = BYTES[accounting]
    w, g, k = accounting
    return {"weights": w * psi / n_d if stage == 3 else w * psi,
            "grads": g * psi / n_d if stage >= 2 else g * psi,
            "optimizer": k * psi / n_d if stage >= 1 else k * psi}


def bubble_fraction(schedule, p, m, v=1, costs=(1, 2, 1)):
    if schedule == "naive":
        return Fraction(p - 1, p)
    if schedule in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if schedule == "interleaved":
        return Fraction(p - 1, v * m + p - 1)
    if schedule == "zb-h1":
        f, b, w = map(Fraction, costs)
        idle = (p - 1) * (f + b - 2 * w)
        return idle / (m * (f + b) + idle)
    raise ValueError(f"unknown schedule {schedule}")


def in_flight(p, m, v=1):
    if v == 1:
        return Fraction(min(p, m))
    return min(Fraction(m), p + Fraction(p - 1, v))


def choose(estimates, cap_bytes):
    fitting = [e for e in estimates if e.memory_bytes_per_gpu <= cap_bytes]
    return min(fitting, key=lambda e: e.step_time_s) if fitting else None
