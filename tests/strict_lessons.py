"""Every lesson at a tiny size in ONE job, as the grader's plug-in check runs them: each
lesson's main() in this process on COMM_WORLD (minidist.cli.running), its report kept.

    MINIDIST_DEVICE=strict mpirun -n 4 python tests/strict_lessons.py OUT.json

tests/test_strict_lessons.py runs it under the strict device double at 1 and 4 ranks and
once on the CPU at 4, and compares: every lesson MATCHes, the strict run counts its
host<->device bytes, every other figure equals the CPU's, and no line is wider than 100. One job for all the lessons
saves starting Python, NumPy and MPI fourteen times over.

Rank 0 writes {lesson: {"match": bool, "figures": {...}, "widest": line}} (figures as the
lesson's --json holds them, with its memory by category and its bytes sent beside them; the widest line the lesson printed, as it built it: the lines of
a class's terminal stay within 100 columns). A lesson that raises ends the whole job with its traceback (minidist's fail-fast),
as it would alone.
"""
import json
import sys
import time

from minidist import cli
from minidist.grader.plugin import lesson_module

SMALL = ("--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--batch-size", "8")
TINY = ("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8")
ONE_PROCESS = {"00", "12"}     # run on rank 0 alone, the others wait (as the grader runs them)


def lessons(n):
    """(lesson, flags) at world size n (1 or 4): lessons 00-09 at the Makefile's demo flags with a
    small shape (every section prints), 10-13 tiny (their own tests print every line they have);
    the planner (12), one process's arithmetic whatever the world, at n = 1 only."""
    return [
        ("00_single_process", (*SMALL, "--steps", "2", "--sample-tokens", "20", "--eval-interval", "1",
                               "--log-interval", "1", "--peak-tflops", "1")),
        ("01_collectives", ("--size-mib", "0.01", "--repeats", "1")),
        ("02_data_parallel", (*SMALL, "--steps", "2", "--timing-reps", "1")),
        ("03_tensor_parallel", (*SMALL, "--steps", "2", "--generate", "8")),
        ("04_pipeline_parallel", ("--schedule", "1f1b", "--micro-batches", "8", *SMALL, "--steps", "1",
                                  "--n-layer", "4")),
        ("05_zero", ("--stage", "all", *SMALL, "--steps", "2")),
        ("06_fsdp", (*SMALL, "--steps", "2")),
        ("07_3d_parallel", ("--tp", "2" if n == 4 else "1", "--pp", "2" if n == 4 else "1", "--dp", "1", *SMALL,
                            "--steps", "1", "--n-layer", "4")),
        ("08_activation_recompute", ("--tp", str(n), *SMALL, "--steps", "2", "--sweep", "4,9")),
        ("09_moe", (*SMALL[:-2], "--batch-size", "12", "--steps", "2")),
        ("10_precision_and_compression", ("--n-layer", "1", "--n-embd", "16", "--block-size", "8",
                                          "--batch-size", str(2 * n), "--steps", "4", "--eval-iters", "1",
                                          "--eval-interval", "4", "--precision", "bf16")),
        ("11_checkpoints", ("--n-layer", "2", *TINY[2:], "--batch-size", str(2 * n), "--steps", "4",
                            "--save-every", "2", "--no-kill",
                            *(("--save-layout", "zero3", "--resume-layout", "tp2pp2") if n == 4 else
                              ("--save-layout", "single", "--resume-layout", "single")))),
        *([("12_plan", ("--gpus", "16", "--params", "7e9", "--no-published"))] if n == 1 else []),
        ("13_context_parallel", ("--cp", str(n), *TINY, "--seq", str(4 * n + 2), "--batch-size", "2",
                                 "--attn-block", "2", "--steps", "1", "--timing-reps", "1")),
    ]


def main(out_path, only=()):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    results = {}
    for lesson, flags in lessons(world.Get_size()):
        if only and lesson[:2] not in only:
            continue
        mod, start = lesson_module(lesson), time.perf_counter()
        args = mod.build_parser().parse_args(list(flags))
        comm = world if lesson[:2] not in ONE_PROCESS else world.Split(0 if world.Get_rank() == 0 else 1)
        if lesson[:2] not in ONE_PROCESS or world.Get_rank() == 0:
            with cli.running(comm) as said:     # a lesson that raises ends the job (fail-fast)
                mod.main(args)
            report = said.reports[-1]
            figures = dict(report.get("figures") or {}, memory=report.get("memory") or {},
                           comm=report.get("comm") or {})     # bytes by category, bytes sent
            results[lesson] = {"match": bool(report.get("match")), "figures": figures,
                               "widest": max(said.lines, key=len, default=""),
                               "seconds": time.perf_counter() - start}
        if comm is not world:
            comm.Free()
        world.Barrier()
    if world.Get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], only=tuple(sys.argv[2:]))
