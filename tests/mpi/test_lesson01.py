"""Lesson 01 and the collectives benchmark run to the end at every world size.

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_lesson01.py
"""
import importlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from minidist.comm import ring_all_reduce

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
        assert report["parallel"] is None and report["steps"] is None   # nothing trained
        assert report["comm"]["bytes_sent"] == report["comm"]["expected_bytes"]
        assert set(report["comm"]["bytes_sent"]) >= {"all_reduce", "reduce_scatter", "all_gather"}
        shutil.rmtree(path.parent)


class RecordingComm:
    """Forwards Sendrecv to the real communicator and notes what each call sent."""

    def __init__(self, comm):
        self.comm, self.sent = comm, []

    def Get_size(self):
        return self.comm.Get_size()

    def Get_rank(self):
        return self.comm.Get_rank()

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):
        self.sent.append((dest, decode(sendbuf, self.comm.Get_size())))
        self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)


def encode(rank, n, per_chunk):
    """Rank r's array: every element of its piece of chunk c is 2**r + 2**(n + c).

    A sum of the pieces of ranks S is sum(2**r for r in S) + |S| * 2**(n + c): the low
    n bits name the ranks, the rest the chunk, so one element tells what was sent.
    """
    return np.concatenate([np.full(per_chunk, 2.0 ** rank + 2.0 ** (n + c)) for c in range(n)])


def decode(buf, n):
    """(chunk, set of ranks whose pieces are summed) from a buffer the ring sends."""
    assert buf.size and np.all(buf == buf[0]), "a ring step sends one whole chunk"
    v = int(buf[0])
    mask = v % 2 ** n
    ranks = {r for r in range(n) if mask >> r & 1}
    chunk = ((v - mask) // len(ranks)).bit_length() - 1 - n
    return chunk, frozenset(ranks)


def test_the_drawn_ring_is_the_schedule_the_ring_runs(comm, capsys):
    """Every step the drawing shows, rank by rank, is what ring_all_reduce really sends."""
    n, rank = comm.Get_size(), comm.Get_rank()
    drawn, held = lesson.draw_ring(n)
    recorder = RecordingComm(comm)
    out = ring_all_reduce(recorder, encode(rank, n, per_chunk=3), check=False)
    letters = "abcdefghijklmnopqrstuvwxyz"
    expected = [((rank + 1) % n, (chunk, frozenset(letters.index(x) for x in pieces)))
                for phase, s, sent in drawn for sender, chunk, pieces in sent if sender == rank]
    assert recorder.sent == expected, f"rank {rank}: drawn {expected}, ran {recorder.sent}"
    assert len(drawn) == 2 * (n - 1)
    assert all(cell == set(letters[:n]) for row in held for cell in row), "a chunk is incomplete at the end"
    assert np.array_equal(out, sum(encode(r, n, 3) for r in range(n)))
    if rank == 0 and n > 1:
        assert f"reduce-scatter step {n - 1} of {n - 1}" in capsys.readouterr().out


def test_bench_prints_both_and_the_ratio(capsys, comm):
    from minidist.bench import collectives as bench
    assert bench.main(["-b", "8", "-e", "4K", "-f", "8", "-n", "1", "-w", "0"]) == 0
    if comm.Get_rank() == 0:
        out = capsys.readouterr().out
        assert "minidist ring" in out and "MPI Allreduce" in out and "ring/MPI" in out
        assert len([l for l in out.splitlines() if l.strip() and not l.startswith("#")]) == 4
