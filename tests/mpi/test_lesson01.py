"""Lesson 01 and the collectives benchmark run to the end at every world size.

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_lesson01.py
"""
import importlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

lesson = importlib.import_module("minidist.lessons.01_collectives")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lesson_matches_and_bytes_equal_the_formulas(comm, dtype):
    # only rank 0 writes the report (and only rank 0 makes a folder: ranks that all
    # create pytest's numbered tmp_path folders at once race in its cleanup)
    path = Path(tempfile.mkdtemp() if comm.Get_rank() == 0 else "unused") / "report.json"
    args = lesson.build_parser().parse_args(
        ["--size-mib", "0.05", "--repeats", "1", "--no-draw", "--dtype", dtype, "--json", str(path)])
    code = lesson.main(args)
    assert code == 0, f"lesson 01 did not match on rank {comm.Get_rank()} ({dtype})"
    if comm.Get_rank() == 0:
        report = json.loads(path.read_text())
        assert report["match"] is True and report["world_size"] == comm.Get_size()
        assert report["comm"]["bytes_sent"] == report["comm"]["expected_bytes"]
        assert set(report["comm"]["bytes_sent"]) >= {"all_reduce", "reduce_scatter", "all_gather"}
        shutil.rmtree(path.parent)


def test_the_ring_drawing_ends_with_every_chunk_everywhere(capsys, comm):
    lesson.draw_ring(3)
    if comm.Get_rank() == 0:
        out = capsys.readouterr().out
        last_table = out.split("all-gather step 2/2")[1]
        assert last_table.count("all") >= 9, out


def test_bench_prints_both_and_the_ratio(capsys, comm):
    from minidist.bench import collectives as bench
    assert bench.main(["-b", "8", "-e", "4K", "-f", "8", "-n", "1", "-w", "0"]) == 0
    if comm.Get_rank() == 0:
        out = capsys.readouterr().out
        assert "minidist ring" in out and "MPI Allreduce" in out and "ring/MPI" in out
        assert len([l for l in out.splitlines() if l.strip() and not l.startswith("#")]) == 4
