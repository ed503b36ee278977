"""The planner's picture (minidist/plan/plot.py, `python -m minidist.plan --plot PATH`): a PNG
written by hand, decoded here with zlib alone: its signature, chunks and CRCs, its size, rows
with filter 0; the Pareto front (the fastest that fit for their memory) chosen right and drawn
in its colour where its points are; fitting and non-fitting layouts in their colours; a path
that cannot be written gets one line and exit 2."""
import struct
import zlib
from types import SimpleNamespace

import pytest

from minidist.plan import plot
from minidist.plan.__main__ import main

SMALL = ["--layers", "2", "--hidden", "1024", "--heads", "4", "--seq", "1024", "--gpus", "8",
         "--global-batch", "8", "--tp", "2"]          # 180 layouts: a fraction of a second


def decode(data):
    """(width, height, rows of RGB bytes) of an 8-bit RGB PNG, each chunk's CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + n
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    w, h, depth, colour, comp, filt, lace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, comp, filt, lace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)               # filter type 0 on every row
    return w, h, [r[1:] for r in rows]


def pixel(rows, x, y):
    x, y = int(x), int(y)
    return tuple(rows[y][3 * x:3 * x + 3])


def has(flat, rgb):
    """Whether some pixel of the flat RGB bytes is rgb (a match aligned on a pixel)."""
    i = flat.find(bytes(rgb))
    while i >= 0 and i % 3:
        i = flat.find(bytes(rgb), i + 1)
    return i >= 0


def est(mem_gb, step_s, fits, tp=1):
    lay = SimpleNamespace(tp=tp, cp=1, pp=1, dp=8, micro_batch=1, chunks=1, zero=0,
                          sequence_parallel=False, recompute="none")
    return SimpleNamespace(memory_bytes_per_gpu=mem_gb * 1e9, step_time_s=step_s, fits=fits,
                           layout=lay)


def test_pareto_keeps_the_fastest_that_fit_for_their_memory():
    pts = [(10, 5.0, 0), (20, 4.0, 1), (20, 3.0, 2), (30, 3.5, 3), (40, 2.0, 4), (5, 9.0, 5)]
    assert plot.pareto(pts) == [(5, 9.0, 5), (10, 5.0, 0), (20, 3.0, 2), (40, 2.0, 4)]


def test_the_png_decodes_and_draws_the_front_in_its_colour(tmp_path):
    # the planner's order: the fastest that fits first; 70 GB and over do not fit 80 GB HBM
    ests = [est(60, 2.0, True), est(10, 8.0, True), est(30, 4.0, True), est(40, 6.0, True),
            est(50, 5.0, True), est(75, 1.0, False), est(120, 0.5, False), est(900, 0.4, False)]
    path = tmp_path / "layouts.png"
    summary = plot.write(path, ests, 80e9, "a test")
    w, h, rows = decode(path.read_bytes())
    assert (w, h) == (plot.W, plot.H)
    assert sorted(summary["front"]) == [0, 1, 2]       # 40 and 50 GB are slower than 30 GB's
    assert summary["left_out"] == 1 and summary["drawn"] == 7     # 900 GB is past 2 x HBM
    to_px = summary["to_px"]
    for i in summary["front"]:                          # each front point in the front's colour
        assert pixel(rows, *to_px(ests[i].memory_bytes_per_gpu / 1e9, ests[i].step_time_s)) == plot.FRONT
    assert pixel(rows, *to_px(40, 6.0)) == plot.FITS
    assert pixel(rows, *to_px(50, 5.0)) == plot.FITS
    assert pixel(rows, *to_px(120, 0.5)) == plot.NOFIT
    # the front's staircase: at 45 GB (between the 30 and 60 GB points) at 30 GB's 4 s
    assert pixel(rows, *to_px(45, 4.0)) == plot.FRONT
    flat = b"".join(rows)
    assert all(has(flat, c) for c in (plot.FRONT, plot.FITS, plot.NOFIT, plot.CHOSEN, plot.USABLE))


def test_the_command_line_writes_it_and_a_bad_path_is_one_line(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert main(SMALL + ["--json", "--plot", str(out)]) == 0
    capsys.readouterr()
    w, h, rows = decode(out.read_bytes())
    assert (w, h) == (plot.W, plot.H)
    inside = b"".join(r[3 * (plot.LEFT + 3):3 * plot.RIGHT] for r in rows[plot.TOP:plot.BOTTOM])
    assert has(inside, plot.FRONT)                    # the front inside the axes, not the legend's
    for bad in (tmp_path / "no such folder" / "x.png", tmp_path):
        with pytest.raises(SystemExit) as err:
            main(SMALL + ["--pp", "1", "--only", "--plot", str(bad)])
        got = capsys.readouterr()
        assert err.value.code == 2 and got.out == ""
        assert got.err.count("\n") == 1 and got.err.startswith("python -m minidist.plan: error: --plot")
