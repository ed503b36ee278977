"""bubble_fraction right, but in floats: 1/3 is not exact."""
EXPECT = {"12.2": "return a fractions.Fraction"}
RANKS = 1


def bubble_fraction(schedule, p, m, v=1, costs=(1, 2, 1)):
    if schedule == "naive":
        return (p - 1) / p
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        f, b, w = costs
        idle = (p - 1) * (f + b - 2 * w)
        return idle / (m * (f + b) + idle)
    raise ValueError(schedule)
