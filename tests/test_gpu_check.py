"""`make gpu-check` and minidist/gpu_check.py: without a GPU one line and exit 0, nothing run;
with one (here a fake runner in its place) a row per run, a table of 100 columns, the JSON,
and a non-zero exit when a verdict is not MATCH. The bench's --device refuses a clash."""
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minidist import gpu_check
from minidist.bench import model as bench_model

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = gpu_check.find_gpu() is None


@pytest.mark.skipif(not NO_GPU or shutil.which("make") is None, reason="needs a machine with make and no GPU")
def test_make_gpu_check_without_a_gpu_says_so_in_one_line_and_builds_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert "no GPU" in lines[0] and "nothing was run" in lines[0] and len(lines[0]) <= 100
    assert not (ROOT / "gpu-check.json").exists()


@pytest.mark.skipif(not NO_GPU, reason="a GPU is here")
def test_the_module_without_a_gpu_says_so_in_one_line(tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, "-m", "minidist.gpu_check", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, MINIDIST_DEVICE="cuda"))
    assert proc.returncode == 0 and (proc.stdout + proc.stderr).splitlines() == [
        "gpu-check: no GPU here (nvidia-smi and CuPy find none): nothing was run"], proc.stdout + proc.stderr
    assert not out.exists()


def test_a_gpu_without_cupy_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "find_gpu", lambda: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "have_cupy", lambda: False)
    assert gpu_check.main([]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1 and "CuPy is not installed" in said.err


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H200", "float32", 67e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),         # the planner's own figure
    ("NVIDIA A100-SXM4-40GB", "float64", 19.5e12),
    ("NVIDIA H100 PCIe", "float32", None),             # a lower peak than the SXM board's
    ("Tesla T4", "float32", None),
])
def test_the_datasheet_peak_by_the_gpus_name(name, dtype, peak):
    got, source = gpu_check.datasheet_peak(name, dtype)
    assert got == peak
    assert source == (f"peak unknown for {name}" if peak is None else f"{gpu_check.gpu_type(name)} {dtype} datasheet")


def fake_runner(mismatch=(), ran=None):
    """A runner that writes the report each command would: `mismatch` lessons say match false."""
    def run(cmd, env, timeout):
        if ran is not None:
            ran.append((cmd, env["MINIDIST_DEVICE"]))
        out = cmd[cmd.index("--json") + 1] if "--json" in cmd else None
        name = next((w for w in cmd if w.startswith("minidist.")), "pytest")
        if name == "minidist.bench":
            Path(out).write_text(json.dumps(dict(dtype="float32", step_time_s=0.01, tokens_per_s=102400.0,
                                                 mfu=0.004, peak_flops=67e12, peak_source="--peak-tflops")))
            return 0, "ran\n"
        if out is None:
            return 0, "3 passed\n"
        bad = name.split(".")[-1] in mismatch
        Path(out).write_text(json.dumps(dict(match=not bad, step_time_s=0.02,
                                             figures=dict(host_device_bytes_per_step=2048))))
        return int(bad), "".join(f"line {i}\n" for i in range(40)) + "verdict: MISMATCH\n"
    return run


@pytest.fixture
def on_h200(monkeypatch, tmp_path):
    tests = tmp_path / "tests"
    (tests / "mpi").mkdir(parents=True)
    for name in ("test_strict_engine.py", "test_strict_double.py", "test_strict_lessons.py",
                 "mpi/test_strict_comm.py"):
        (tests / name).write_text("")
    monkeypatch.setattr(gpu_check, "find_gpu", lambda: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "have_cupy", lambda: True)
    real_plan = gpu_check.plan
    monkeypatch.setattr(gpu_check, "plan", lambda *a: real_plan(*a, tests=tests))
    return tmp_path


def test_every_lesson_the_tests_and_the_bench_run_and_all_match(on_h200, capsys):
    ran = []
    out = on_h200 / "gpu-check.json"
    assert gpu_check.main(["--json", str(out)], runner=fake_runner(ran=ran)) == 0
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["gpu"] == "NVIDIA H200" and report["peak_flops"] == 67e12
    runs = report["runs"]
    lessons = [(r["name"], r["ranks"]) for r in runs if r["kind"] == "lesson"]
    assert len(lessons) == 25 and ("00_single_process", 2) not in lessons and ("13_context_parallel", 2) in lessons
    assert not any(name.startswith("12_") for name, _ in lessons)
    assert all(r["verdict"] == "MATCH" and r["host_device_bytes_per_step"] == 2048 and r["step_time_s"] == 0.02
               for r in runs if r["kind"] == "lesson")
    tests = [r["command"] for r in runs if r["kind"] == "tests"]
    assert len(tests) == 2 and tests[0].endswith(" tests/test_strict_engine.py")      # the CPU suite's: not run
    assert "double" not in " ".join(tests) and "lessons" not in " ".join(tests)
    assert "--only-mpi" in tests[1] and " -n 2 " in tests[1]
    bench = runs[-1]
    assert bench["kind"] == "bench" and "--device cuda --peak-tflops 67" in bench["command"]
    assert bench["peak_source"] == "h200 float32 datasheet" and bench["mfu"] == 0.004
    assert {device for _, device in ran} == {"cuda"} and len(ran) == len(runs) == 28
    said = capsys.readouterr().out
    assert "MFU 0.40% of 67.0 TFLOP/s (h200 float32 datasheet)" in said and "28 of 28 runs passed" in said
    assert max(len(line) for line in said.splitlines()) <= 100


def test_a_mismatch_prints_its_last_lines_and_exits_non_zero(on_h200, capsys):
    out = on_h200 / "gpu-check.json"
    assert gpu_check.main(["--json", str(out)], runner=fake_runner(mismatch=("09_moe",))) == 1
    report = json.loads(out.read_text())
    bad = [r for r in report["runs"] if not r["ok"]]
    assert report["ok"] is False and [(r["name"], r["verdict"]) for r in bad] == [("09_moe", "MISMATCH")] * 2
    assert bad[0]["tail"][-1] == "verdict: MISMATCH" and len(bad[0]["tail"]) == gpu_check.TAIL
    said = capsys.readouterr().out
    assert "  | verdict: MISMATCH" in said and "  | line 39" in said and "  | line 10\n" not in said
    assert "26 of 28 runs passed; failed: 09_moe -n 1, 09_moe -n 2\n" in said


def test_a_run_without_a_report_or_out_of_time_is_not_a_match(tmp_path):
    job = dict(kind="lesson", name="03_tensor_parallel", ranks=2, json=str(tmp_path / "none.json"), cmd=["x"])
    assert gpu_check.result(job, 0, "", 1.0)["verdict"] == "no report"
    row = gpu_check.result(job, None, "stuck\n", 600.0)
    assert row["verdict"] == "timed out" and row["ok"] is False and row["tail"] == ["stuck"]


def test_an_unknown_gpu_gets_no_mfu(monkeypatch, on_h200, capsys):
    monkeypatch.setattr(gpu_check, "find_gpu", lambda: "Tesla T4")
    assert gpu_check.main([], runner=fake_runner()) == 0
    said = capsys.readouterr().out
    assert "no MFU (peak unknown for Tesla T4)" in said and "--peak-tflops" not in said


def test_the_bench_sets_the_device_or_refuses_a_clash(monkeypatch):
    monkeypatch.delenv("MINIDIST_DEVICE", raising=False)
    monkeypatch.setitem(sys.modules, "minidist.backend", type(sys)("fake_backend"))
    sys.modules["minidist.backend"].DEVICE = "cpu"
    assert bench_model.select_device("strict") == "--device strict: this process already runs on cpu"
    assert bench_model.select_device("cpu") is None and os.environ["MINIDIST_DEVICE"] == "cpu"
    monkeypatch.delitem(sys.modules, "minidist.backend")
    monkeypatch.setenv("MINIDIST_DEVICE", "strict")
    assert "MINIDIST_DEVICE=strict" in bench_model.select_device("cuda")
    monkeypatch.delenv("MINIDIST_DEVICE")
    assert bench_model.select_device("cuda") is None and os.environ["MINIDIST_DEVICE"] == "cuda"
