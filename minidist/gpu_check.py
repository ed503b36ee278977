"""The check for the day a GPU is here: the lessons, the device tests and the bench on CuPy.

    make gpu-check                        # .venv with CuPy (the gpu extra), then this command
    MINIDIST_DEVICE=cuda python -m minidist.gpu_check --json gpu-check.json

It runs every lesson that computes on arrays (00-11 and 13; 12 is the planner's arithmetic)
with MINIDIST_DEVICE=cuda at a small shape, on 1 rank and on 2 (both ranks may share one GPU;
lesson 00 is single-process), then the device tests with the same setting (DEVICE_TESTS below:
the comm layer's and the engine's) and `python -m minidist.bench model --device cuda`, whose
MFU is taken against the GPU's datasheet peak (minidist/plan/cluster.py's GPU names, for the
bench's dtype). Each run's command, exit code, verdict (a lesson's --json "match"), step time
and host<->device bytes per step go into one JSON and a table; a run that fails prints its
last lines. The exit code is 0 only when every lesson MATCHes and the tests and the bench pass.

Without a GPU it prints one line and exits 0: nothing was run. `--device strict` rehearses the
whole check on the CPU under the device double (minutes); `--list` prints the commands only.
"""
import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from minidist.cli import json_problem, positive_float
from minidist.progress import Progress

WIDTH = 100
ROOT = Path(__file__).resolve().parents[1]
TAIL = 15                      # lines of a failed run's output kept and printed

# (lesson, flags, rank counts): small shapes, the lesson's own figures all printed.
LESSONS = [
    ("00_single_process", ["--steps", "30", "--sample-tokens", "20", "--eval-interval", "15"], (1,)),
    ("01_collectives", ["--repeats", "2", "--no-draw"], (1, 2)),
    ("02_data_parallel", ["--timing-reps", "1"], (1, 2)),
    ("03_tensor_parallel", [], (1, 2)),
    ("04_pipeline_parallel", [], (1, 2)),
    ("05_zero", ["--stage", "all"], (1, 2)),
    ("06_fsdp", [], (1, 2)),
    ("07_3d_parallel", [], (1, 2)),
    ("08_activation_recompute", ["--sweep", "2", "--timing-reps", "1"], (1, 2)),
    ("09_moe", [], (1, 2)),
    ("10_precision_and_compression", ["--steps", "20", "--eval-interval", "10"], (1, 2)),
    ("11_checkpoints", [], (1, 2)),
    ("13_context_parallel", ["--timing-reps", "1"], (1, 2)),
]

# The device tests: the comm layer's run in this process on MINIDIST_DEVICE's arrays (on 1 and
# on 2 ranks); the engine's compares a cpu and a strict run it starts itself. The other
# tests/test_strict_*.py are the CPU suite's (the double's own, the lessons under it).
DEVICE_TESTS = ("test_strict_comm.py", "test_strict_engine.py")
MPI_DEVICE_TESTS = ("mpi/test_strict_comm.py",)

# Dense peaks by the planner's GPU names (minidist/plan/cluster.py): bf16 is the table's own
# peak_flops; the bench's float32 and float64 come from the same datasheets. float32 is the
# CUDA-core figure, not TF32's: CuPy's matmul uses TF32 only with CUPY_TF32=1
# (cupy/_core/_routines_linalg.pyx, get_compute_type); cuBLAS runs float64 on the FP64 tensor cores.
DATASHEET = {  # name: (float32, float64) FLOP/s
    "a100-80gb": (19.5e12, 19.5e12),    # A100 datasheet: FP32 19.5, FP64 Tensor Core 19.5 TFLOPS
    "h100-sxm": (67e12, 67e12),         # H100 SXM datasheet: FP32 67, FP64 Tensor Core 67 TFLOPS
    "h200": (67e12, 67e12),             # H200 SXM datasheet: FP32 67, FP64 Tensor Core 67 TFLOPS
}


def gpu_type(name):
    """The planner's name for a GPU as the driver names it, or None: the PCIe and NVL
    boards of H100/H200 have lower peaks than the SXM ones the table holds."""
    n = name.lower()
    if "a100" in n:                     # 40 GB, 80 GB, SXM and PCIe share these peaks
        return "a100-80gb"
    if "pcie" in n or "nvl" in n:
        return None
    return "h200" if "h200" in n else "h100-sxm" if "h100" in n else None


def datasheet_peak(name, dtype):
    """(FLOP/s, where it comes from) for a GPU name and 'float32' / 'float64' / 'bf16', or
    (None, 'peak unknown for NAME')."""
    from minidist.plan.cluster import GPUS
    kind = gpu_type(name)
    if kind is None or kind not in GPUS:
        return None, f"peak unknown for {name}"
    peaks = {"bf16": GPUS[kind].peak_flops, "float32": DATASHEET[kind][0], "float64": DATASHEET[kind][1]}
    return peaks[dtype], f"{kind} {dtype} datasheet"


def find_gpu():
    """The first GPU's name, or None: nvidia-smi's list, else CuPy's device count."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0 and names:
            return names[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:            # no CuPy, no driver, no device: each its own exception type
        pass
    return None


def have_cupy():
    return importlib.util.find_spec("cupy") is not None


def launcher():
    """mpirun as words: MINIDIST_MPIRUN, else beside this Python, else on PATH (the grader's rule)."""
    if os.environ.get("MINIDIST_MPIRUN"):
        return shlex.split(os.environ["MINIDIST_MPIRUN"])
    beside = Path(sys.executable).with_name("mpirun")
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    return [found] if found else None


def plan(device, folder, peak=None, source=None, tests=ROOT / "tests"):
    """The runs, in order: dicts with kind, name, ranks, cmd (a list), short (the command as
    printed) and json (a path or None). peak: the GPU's FLOP/s for the bench's MFU (None:
    unknown, said by `source`; under strict the bench's own measured peak is used)."""
    py, mpirun, jobs = sys.executable, launcher(), []

    def job(kind, name, ranks, words, report=True):
        out = str(Path(folder) / f"{name.replace(' ', '-')}-{ranks}.json") if report else None
        prefix = [] if ranks == 1 else [*(mpirun or ["mpirun"]), "-n", str(ranks)]
        short = " ".join([*(["mpirun", "-n", str(ranks)] if ranks > 1 else []), "python", *words])
        jobs.append(dict(kind=kind, name=name, ranks=ranks, json=out, short=short,
                         cmd=[*prefix, py, *words, *(["--json", out] if out else [])]))

    for lesson, flags, worlds in LESSONS:
        for n in worlds:
            job("lesson", lesson, n, ["-m", f"minidist.lessons.{lesson}", *flags])
    serial = [f"{tests.name}/{t}" for t in DEVICE_TESTS if (tests / t).exists()]
    if serial:
        job("tests", "tests", 1, ["-m", "pytest", "-q", "-p", "no:cacheprovider", *serial], report=False)
    ranked = [f"{tests.name}/{t}" for t in MPI_DEVICE_TESTS if (tests / t).exists()]
    if ranked:
        job("tests", "mpi tests", 2, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--only-mpi", *ranked],
            report=False)
    given = ["--peak-tflops", f"{peak / 1e12:g}"] if peak else []
    job("bench", "bench model", 1, ["-m", "minidist.bench", "model", "--device", device, *given])
    jobs[-1].update(peak_source=source, mfu_known=bool(peak) or device != "cuda")
    return jobs


def run_command(cmd, env, timeout):
    """(exit code, or None when it outlived `timeout` and was killed; its output)."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT, start_new_session=True)
    except OSError as e:                                   # no mpirun, say
        return -1, f"could not start {cmd[0]}: {e.strerror} (MINIDIST_MPIRUN names the launcher)"
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


def read_report(path):
    """The run's --json as a dict, or None when it wrote none (or half of one)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None


def result(job, code, output, seconds):
    """A job's row: what ran, how it ended, its verdict and figures, its last lines if it failed."""
    rep = read_report(job["json"]) if job["json"] else None
    row = dict(kind=job["kind"], name=job["name"], ranks=job["ranks"], command=shlex.join(job["cmd"]),
               exit_code=code, seconds=round(seconds, 2), step_time_s=None, host_device_bytes_per_step=None)
    if job["kind"] == "lesson":
        row["verdict"] = "no report" if rep is None else "MATCH" if rep.get("match") is True else "MISMATCH"
        row["ok"] = code == 0 and row["verdict"] == "MATCH"
        if rep is not None:
            row["step_time_s"] = rep.get("step_time_s")
            row["host_device_bytes_per_step"] = (rep.get("figures") or {}).get("host_device_bytes_per_step")
    elif job["kind"] == "tests":
        row["ok"] = code == 0
        row["verdict"] = "passed" if row["ok"] else "failed"
    else:                                               # the bench: its figures, when it wrote them
        row["ok"] = code == 0 and rep is not None
        row["verdict"] = "ran" if row["ok"] else "failed"
        for key in ("step_time_s", "tokens_per_s", "mfu", "peak_flops", "peak_source", "dtype"):
            row[key] = (rep or {}).get(key)
        if rep is not None and job.get("peak_source"):       # the datasheet's name for --peak-tflops
            row["peak_source"] = job["peak_source"]
        if not job.get("mfu_known", True):                    # no datasheet peak: no MFU
            row["mfu"] = row["peak_flops"] = None
    if code is None:
        row["verdict"] = "timed out"
    if not row["ok"]:
        row["tail"] = (output or "").splitlines()[-TAIL:]
    return row


def cell(x, scale=1.0, fmt="{:,.1f}"):
    return "-" if x is None else fmt.format(x * scale)


def table(rows):
    """The rows as lines of at most 100 columns: one per run, then the bench's MFU."""
    head = f"{'run':<33}{'ranks':>5}{'exit':>6}  {'verdict':<10}{'step ms':>9}{'h<->d B/step':>14}{'wall s':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        code = "-" if r["exit_code"] is None else str(r["exit_code"])
        lines.append(f"{r['name'][:32]:<33}{r['ranks']:>5}{code:>6}  {r['verdict']:<10}"
                     f"{cell(r['step_time_s'], 1e3):>9}{cell(r['host_device_bytes_per_step'], 1, '{:,.0f}'):>14}"
                     f"{r['seconds']:>9.1f}")
    for r in rows:
        if r["kind"] == "bench" and r["ok"]:
            mfu = (f"MFU {r['mfu'] * 100:.2f}% of {r['peak_flops'] / 1e12:,.1f} TFLOP/s"
                   if r.get("mfu") is not None and r.get("peak_flops") else "no MFU")
            lines.append(f"bench model ({r.get('dtype')}): {cell(r.get('tokens_per_s'), 1, '{:,.0f}')} tokens/s, "
                         f"{mfu} ({r.get('peak_source')})"[:WIDTH])
    bad = [r for r in rows if not r["ok"]]
    lines = [line[:WIDTH] for line in lines] + [f"{len(rows) - len(bad)} of {len(rows)} runs passed" +
                                                  ("; failed:" if bad else "")]
    for r in bad:                                     # the failed runs, as many to a line as fit
        item = f" {r['name']} -n {r['ranks']}" + ("," if r is not bad[-1] else "")
        if len(lines[-1]) + len(item) > WIDTH:
            lines.append(" ")
        lines[-1] += item
    return lines


def check(jobs, device, runner=run_command, timeout=600.0, out=None):
    """Run the jobs one after another; the rows, each failure's last lines printed as it ends."""
    out = sys.stdout if out is None else out
    env = dict(os.environ, MINIDIST_DEVICE=device)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    bar, rows = Progress(len(jobs), "gpu-check", stream=out, every=1), []
    for i, job in enumerate(jobs):
        t0 = time.perf_counter()
        code, output = runner(job["cmd"], env, timeout)
        rows.append(result(job, code, output, time.perf_counter() - t0))
        bar.update(i + 1, f"{job['name']} -n {job['ranks']}: {rows[-1]['verdict']}")
        if not rows[-1]["ok"]:
            bar.close()
            print(textwrap.fill(job["short"], WIDTH, initial_indent="  ", subsequent_indent="      ",
                                break_on_hyphens=False), file=out)
            for line in rows[-1]["tail"]:                 # a long line in pieces, none lost
                for i in range(0, max(1, len(line)), WIDTH - 4):
                    print(f"  | {line[i:i + WIDTH - 4]}", file=out)
    bar.close()
    return rows


def main(argv=None, runner=run_command):
    p = argparse.ArgumentParser(prog="python -m minidist.gpu_check", description=__doc__.split("\n")[0])
    env = os.environ.get("MINIDIST_DEVICE", "").lower()
    p.add_argument("--device", choices=["cuda", "strict"], default=env if env in ("cuda", "strict") else "cuda",
                   help="cuda (a GPU, CuPy) or strict (the CPU double: a rehearsal) "
                        "(default: MINIDIST_DEVICE when it names one of them, else cuda)")
    p.add_argument("--json", metavar="PATH", help="write every run's row and the GPU's name as JSON")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds one run may take (600)")
    p.add_argument("--list", action="store_true", help="print the commands and run nothing")
    args = p.parse_args(argv)
    if args.json and json_problem(args.json):
        print(json_problem(args.json), file=sys.stderr)
        return 2
    gpu, peak, source = None, None, None                  # strict: the bench measures its own peak
    if args.device == "cuda" and not args.list:
        gpu = find_gpu()
        if gpu is None:
            print("gpu-check: no GPU here (nvidia-smi and CuPy find none): nothing was run")
            return 0
        if not have_cupy():
            print(f"gpu-check: a GPU is here ({gpu}) but CuPy is not installed: "
                  "pip install -e '.[gpu]', or make gpu-check", file=sys.stderr)
            return 2
        peak, source = datasheet_peak(gpu, "float32")             # the bench's default dtype
    with tempfile.TemporaryDirectory(prefix="minidist-gpu-check-") as folder:
        jobs = plan(args.device, folder, peak, source)
        if args.list:
            print(f"with MINIDIST_DEVICE={args.device}, each lesson and the bench also with --json FILE")
            print(f"python: {sys.executable}"[:WIDTH])
            print(f"mpirun: {shlex.join(launcher() or ['(none found)'])}"[:WIDTH])
            for job in jobs:
                print(textwrap.fill(job["short"], WIDTH, subsequent_indent="    ", break_on_hyphens=False))
            return 0
        where = f"{gpu} ({source})" if gpu else "the strict double, on the CPU"
        print(f"gpu-check on {where}: {len(jobs)} runs, MINIDIST_DEVICE={args.device}"[:WIDTH])
        rows = check(jobs, args.device, runner, args.timeout)
    print("\n".join(table(rows)))
    ok = all(r["ok"] for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, gpu=gpu, peak_flops=peak, peak_source=source, ok=ok, runs=rows),
                      f, indent=2)
            f.write("\n")
        print(f"written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
