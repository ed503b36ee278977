"""The memory calculator (python -m minidist.memory): the ZeRO paper's example, the --json
shape, Korthikanti et al.'s activation formulas, and bad input (exit 2, one message)."""
import json
import subprocess
import sys

import pytest

from minidist.plan.memory import activation_layer_bytes, model_state_bytes


def totals(psi, n):
    """{stage: bytes per device}, the calculator's rows: weights + gradients + optimizer."""
    return {stage: sum(model_state_bytes(psi, n, stage).values()) for stage in range(4)}


def run(*argv):
    return subprocess.run([sys.executable, "-m", "minidist.memory", *argv], capture_output=True, text=True)


def test_paper_example_7_5b_on_64():
    """Rajbhandari et al. 2020, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    gb = {s: v / 1e9 for s, v in totals(7.5e9, 64).items()}
    assert gb[0] == pytest.approx(120.0)
    assert round(gb[1], 1) == 31.4 and round(gb[2], 1) == 16.6 and round(gb[3], 1) == 1.9
    out = run("--params", "7.5e9", "--dp", "64")
    assert out.returncode == 0, out.stderr
    for figure in ("120.00 GB", "31.41 GB", "16.64 GB", "1.88 GB"):
        assert figure in out.stdout


def test_seed_70b_is_16_bytes_per_parameter():
    assert totals(70e9, 1)[0] == 1.12e12     # the seed notes: about 1.12 TB


def test_json_shape():
    out = run("--params", "7.5e9", "--dp", "64", "--json")
    rep = json.loads(out.stdout)
    assert set(rep) == {"params", "dp", "tp", "pp", "params_per_device", "bytes_per_device", "activations"}
    assert set(rep["bytes_per_device"]) == {"0", "1", "2", "3"} and rep["activations"] is None
    assert rep["bytes_per_device"]["3"] == 16 * 7.5e9 / 64
    out = run("--params", "1e9", "--dp", "8", "--seq", "2048", "--batch", "1", "--hidden", "4096",
              "--heads", "32", "--layers", "4", "--tp", "2", "--json")
    acts = json.loads(out.stdout)["activations"]
    s, b, h, a, t = 2048, 1, 4096, 32, 2
    assert acts["per_layer"] == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert acts["total"] == 4 * acts["per_layer"]


def test_tp_and_pp_divide_the_model_states():
    """Each device holds Psi/(t p): --tp 8 --pp 2 is the paper's accounting of Psi/16."""
    rep = json.loads(run("--params", "7.5e9", "--dp", "64", "--tp", "8", "--pp", "2", "--json").stdout)
    assert rep["params_per_device"] == 7.5e9 / 16 and (rep["tp"], rep["pp"]) == (8, 2)
    want = totals(7.5e9 / 16, 64)
    assert {int(k): v for k, v in rep["bytes_per_device"].items()} == want
    assert rep["bytes_per_device"]["0"] == 16 * 7.5e9 / 16
    out = run("--params", "7.5e9", "--dp", "64", "--tp", "8")
    assert out.returncode == 0 and f"{120 / 8:10.2f} GB" in out.stdout, out.stdout


def test_activation_formulas_by_hand():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert activation_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert activation_layer_bytes(s, b, h, a, t, True) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert activation_layer_bytes(s, b, h, a, t, True, "selective") == pytest.approx(34 * s * b * h / t)
    assert activation_layer_bytes(s, b, h, a, 1, False, "full") == 2 * s * b * h


def test_full_recomputation_under_tensor_parallelism():
    """Full recomputation keeps each layer's input, 2sbh: whole on every rank under plain TP
    (the residual stream is replicated), cut t ways only under sequence parallelism."""
    s, b, h, a = 2048, 1, 12288, 96
    for t in (2, 8):
        assert activation_layer_bytes(s, b, h, a, t, False, "full") == 2 * s * b * h, f"t={t} without SP"
        assert activation_layer_bytes(s, b, h, a, t, True, "full") == 2 * s * b * h / t, f"t={t} with SP"
        assert activation_layer_bytes(s, b, h, a, t, False, "selective") == pytest.approx(s * b * h * (10 + 24 / t))


@pytest.mark.parametrize("argv", [["--params", "-1", "--dp", "4"], ["--params", "0", "--dp", "4"],
                                  ["--params", "x", "--dp", "4"], ["--params", "1e9", "--dp", "2.5"],
                                  ["--params", "1e9", "--dp", "4", "--seq", "128"],
                                  ["--params", "nan", "--dp", "4"]])
def test_bad_values_exit_2_with_one_message(argv):
    out = run(*argv)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("error:") == 1, out.stderr


@pytest.mark.parametrize("text, value", [("7.5e9", 7.5e9), ("7.5B", 7.5e9), ("70b", 70e9), ("350M", 350e6),
                                         ("1.2T", 1.2e12), ("7_500_000_000", 7.5e9)])
def test_parameter_counts_as_people_write_them(text, value):
    from minidist.memory import parameter_count
    assert parameter_count(text) == pytest.approx(value, rel=1e-12)


def test_a_bad_parameter_count_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "minidist.memory", "--params", "7.5X", "--dp", "64"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "7.5B, 350M or 1.2T" in lines[0], lines
