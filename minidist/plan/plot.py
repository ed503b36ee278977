"""The planner's picture: step time against memory per GPU, written as a PNG by hand.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm --plot layouts.png

Every layout the search estimated is a point: memory on its fullest GPU (x, GB) against its
step time (y, seconds, log scale). Those that fit (at most the usable memory, USABLE_MEMORY
of the HBM: cost.py) are blue, those that do not grey. The x axis runs to twice the HBM
(layouts past it are left out and counted under the picture; none of them fits), or just past
the largest layout when all of them need under a quarter of the usable memory (the usable
line is then named in the legend only). The Pareto front is the orange staircase:
the fastest layout that fits within each memory budget (a layout is on it when no layout that
fits is both faster and no larger); the first layout the planner lists (the fastest that
fits) is ringed in green; a dashed purple line stands at the usable memory.

No plotting library: the picture is a bytearray of RGB pixels, text is drawn with a 5 x 7
bitmap font of this module's own (FONT), and the file is a PNG built from its parts (the
PNG specification, W3C 2003, sections 5, 9 and 11): the signature, an IHDR chunk (width,
height, 8-bit RGB), one IDAT chunk (every row prefixed by filter type 0, then deflated with
zlib) and IEND, each chunk with its CRC-32. Standard library only (zlib, struct, math).
"""
import math
import struct
import zlib

from minidist.plan.cost import USABLE_MEMORY

GB = 1e9
W, H = 1200, 720                       # the picture, pixels
LEFT, RIGHT, TOP, BOTTOM = 110, 880, 100, 600   # the plot area
S = 2                                  # font scale: glyphs 10 x 14 pixels, 12 apart
WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (228, 228, 228)
FITS, NOFIT = (31, 119, 180), (175, 175, 175)
FRONT, CHOSEN, USABLE = (230, 85, 13), (0, 150, 0), (128, 0, 128)

# 5 x 7 glyphs: seven rows, each a 5-bit mask (bit 4 the left column), as 14 hex digits.
_UPPER = """0E11131519110E 040C040404040E 0E11010204081F 1F02040201110E 02060A121F0202
1F101E0101110E 0608101E11110E 1F010204080808 0E11110E11110E 0E11110F01020C 0E1111111F1111
1E11111E11111E 0E11101010110E 1C12111111121C 1F10101E10101F 1F10101E101010 0E11101711110F
1111111F111111 0E04040404040E 0702020202120C 11121418141211 1010101010101F 111B1515111111
11111915131111 0E11111111110E 1E11111E101010 0E11111115120D 1E11111E141211 0F10100E01011E
1F040404040404 1111111111110E 11111111110A04 1111111515150A 11110A040A1111 1111110A040404
1F01020408101F"""
_LOWER = """00000E010F110F 1010161911111E 00000E1010110E 01010D1311110F 00000E111F100E
0609081C080808 000F11110F010E 10101619111111 04000C0404040E 0200060202120C 10101214181412
0C04040404040E 00001A15151111 00001619111111 00000E1111110E 00001E111E1010 00000D130F0101
00001619101010 00000E100E011E 08081C08080906 0000111111130D 00001111110A04 0000111115150A
0000110A040A11 000011110F010E 00001F0204081F"""
_MARKS = """00000000000000 00000000000C0C 000000000C0408 0000001F000000 0004041F040400
02040808080402 08040202020408 00010204081000 000C0C000C0C00 18190204081303 00001F001F0000
0E110102040004 0000000000001F 08040201020408 02040810080402 04040800000000 000C0C000C0408"""
FONT = dict(zip("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,-+()/:%=?_><';",
                (_UPPER + " " + _LOWER + " " + _MARKS).split()))


class Canvas:
    """W x H RGB pixels, white, with the few primitives the picture needs."""

    def __init__(self, w=W, h=H):
        self.w, self.h = w, h
        self.px = bytearray(WHITE) * (w * h)

    def rect(self, x0, y0, x1, y1, rgb):
        """Fill the pixels x0 <= x < x1, y0 <= y < y1 (clipped to the canvas)."""
        x0, x1 = max(0, int(x0)), min(self.w, int(x1))
        if x1 <= x0:
            return
        run = bytes(rgb) * (x1 - x0)
        for y in range(max(0, int(y0)), min(self.h, int(y1))):
            i = 3 * (y * self.w + x0)
            self.px[i:i + len(run)] = run

    def ring(self, cx, cy, r_in, r_out, rgb):
        for y in range(int(cy - r_out), int(cy + r_out) + 1):
            for x in range(int(cx - r_out), int(cx + r_out) + 1):
                if r_in ** 2 <= (x - cx) ** 2 + (y - cy) ** 2 <= r_out ** 2:
                    self.rect(x, y, x + 1, y + 1, rgb)

    def text(self, x, y, s, rgb=BLACK, scale=S, up=False):
        """s with its top-left corner at (x, y); up: rotated to read bottom to top, (x, y)
        then its bottom-left. Characters the font lacks are drawn as '?'."""
        for k, ch in enumerate(s):
            rows = FONT.get(ch, FONT["?"])
            for r in range(7):
                bits = int(rows[2 * r:2 * r + 2], 16)
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        u, v = (6 * k + c) * scale, r * scale
                        if up:
                            self.rect(x + v, y - u - scale, x + v + scale, y - u, rgb)
                        else:
                            self.rect(x + u, y + v, x + u + scale, y + v + scale, rgb)

    def png(self):
        """The PNG file's bytes: signature, IHDR, IDAT (filter 0 on every row), IEND."""
        def chunk(kind, data):
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
        stride = 3 * self.w
        raw = b"".join(b"\x00" + bytes(self.px[y * stride:(y + 1) * stride]) for y in range(self.h))
        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6))
                + chunk(b"IEND", b""))


def text_width(s, scale=S):
    return 6 * scale * len(s) - scale


def nice_step(span, n=8):
    """A 1, 2 or 5 x 10^k step giving about n intervals over span."""
    raw = span / n
    p = 10 ** math.floor(math.log10(raw))
    return next(m * p for m in (1, 2, 5, 10) if m * p >= raw)


def log_ticks(lo, hi):
    """1, 2, 5 x 10^k within [lo, hi]; 1-9 x 10^k where those are fewer than three; the two
    ends where even those are."""
    for marks in ((1, 2, 5), range(1, 10)):
        out = [m * 10 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
               for m in marks if lo <= m * 10 ** k <= hi]
        if len(out) >= 3:
            return out
    return out if len(out) >= 2 else [lo, hi]


def label(v):
    return f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def pareto(points):
    """Of the (memory, time, index) points given (the caller passes those that fit), the ones
    no other point beats in both memory and time: sorted by memory, so time falls along them.
    Of equal points the first in memory order stays."""
    front, best = [], math.inf
    for m, t, i in sorted(points, key=lambda p: (p[0], p[1])):
        if t < best:
            front.append((m, t, i))
            best = t
    return front


def describe(lay):
    """One layout in a line: 'tp 8 pp 16 dp 128 mb 1 v 8 ZeRO 1 SP recompute selective'."""
    parts = [f"tp {lay.tp}"] + ([f"cp {lay.cp}"] if getattr(lay, "cp", 1) > 1 else []) + [
        f"pp {lay.pp}", f"dp {lay.dp}", f"mb {lay.micro_batch}", f"v {lay.chunks}",
        f"ZeRO {lay.zero}"] + (["SP"] if lay.sequence_parallel else []) + (
        ["TP overlap"] if getattr(lay, "tp_comm_overlap", False) else []) + (
        [f"recompute {lay.recompute}"] if lay.recompute != "none" else [])
    return " ".join(parts)


def render(estimates, hbm_bytes, title="", usable_bytes=None):
    """(Canvas, summary) for a list of estimates (objects with step_time_s,
    memory_bytes_per_gpu, fits and layout), the first of them the planner's choice.
    summary: drawn, left_out, front (indices into estimates), x_max_gb, y range, and
    to_px, the function from (GB, seconds) to pixels (for tests)."""
    usable = USABLE_MEMORY * hbm_bytes if usable_bytes is None else usable_bytes
    pts = [(e.memory_bytes_per_gpu / GB, e.step_time_s, i) for i, e in enumerate(estimates)]
    top = max(m for m, _, _ in pts)
    far = 1.05 * top < 0.25 * usable / GB        # every layout far below the usable memory
    x_max = 1.05 * top if far else max(1.08 * usable / GB, min(2 * hbm_bytes / GB, 1.05 * top))
    if all(m > x_max for m, _, _ in pts):     # none within twice the HBM: draw them all
        x_max = 1.05 * top
    step = nice_step(x_max)
    x_max = step * math.ceil(x_max / step)
    drawn = [p for p in pts if p[0] <= x_max]
    lo, hi = min(p[1] for p in drawn), max(p[1] for p in drawn)
    lo, hi = lo / 1.15, hi * 1.15
    ly0, ly1 = math.log10(lo), math.log10(hi)

    def to_px(m, t):
        return (LEFT + (RIGHT - LEFT) * m / x_max,
                BOTTOM - (BOTTOM - TOP) * (math.log10(t) - ly0) / (ly1 - ly0))

    c = Canvas()
    for k in range(int(round(x_max / step)) + 1):           # grid and ticks
        x = to_px(k * step, lo)[0]
        c.rect(x, TOP, x + 1, BOTTOM, GRID)
        c.rect(x, BOTTOM, x + 1, BOTTOM + 6, BLACK)
        s = label(k * step)
        c.text(x - text_width(s) / 2, BOTTOM + 12, s)
    for t in log_ticks(lo, hi):
        y = to_px(0, t)[1]
        c.rect(LEFT, y, RIGHT, y + 1, GRID)
        c.rect(LEFT - 6, y, LEFT, y + 1, BLACK)
        s = label(t)
        c.text(LEFT - 10 - text_width(s), y - 7, s)
    fits = [e.fits for e in estimates]
    for m, t, i in sorted(drawn, key=lambda p: fits[p[2]]):      # grey under blue
        x, y = to_px(m, t)
        c.rect(x - 2, y - 2, x + 3, y + 3, FITS if fits[i] else NOFIT)
    ux = to_px(usable / GB, lo)[0]
    for y in range(TOP, BOTTOM, 12) if not far else ():      # the usable memory, dashed
        c.rect(ux - 1, y, ux + 2, y + 7, USABLE)
    front = pareto([p for p in drawn if fits[p[2]]])
    for (m, t, _), nxt in zip(front, front[1:] + [(min(usable / GB, x_max), None, None)]):
        x0, y0 = to_px(m, t)
        x1 = to_px(nxt[0], t)[0]
        c.rect(x0, y0 - 1, x1 + 2, y0 + 2, FRONT)           # along at this time...
        if nxt[1] is not None:
            c.rect(x1 - 1, y0, x1 + 2, to_px(nxt[0], nxt[1])[1] + 1, FRONT)   # ...then down
    for m, t, _ in front:
        x, y = to_px(m, t)
        c.rect(x - 4, y - 4, x + 5, y + 5, FRONT)
    first = estimates[0]
    if first.fits:
        x, y = to_px(first.memory_bytes_per_gpu / GB, first.step_time_s)
        c.ring(x, y, 8, 11, CHOSEN)
    c.rect(LEFT, TOP, LEFT + 2, BOTTOM + 1, BLACK)          # the axes
    c.rect(LEFT, BOTTOM - 1, RIGHT + 1, BOTTOM + 1, BLACK)
    xl = "memory per GPU, GB (the fullest GPU of the layout)"
    c.text((LEFT + RIGHT - text_width(xl)) / 2, BOTTOM + 42, xl)
    yl = "step time, s (log scale)"
    c.text(18, (TOP + BOTTOM + text_width(yl)) / 2, yl, up=True)
    c.text(LEFT, 16, title[:90])
    what = (f"first listed, {'the fastest that fits' if first.fits else 'does not fit'}: "
            f"{first.step_time_s:.3g} s per step, {first.memory_bytes_per_gpu / GB:.1f} GB per GPU")
    ink = CHOSEN if first.fits else BLACK
    c.text(LEFT, 42, what[:90], ink)
    c.text(LEFT, 68, ("  " + describe(first.layout))[:90], ink)
    n_fit = sum(fits[i] for _, _, i in drawn)
    legend = [("square", FITS, f"fits ({n_fit:,})"),
              ("square", NOFIT, f"does not fit ({len(drawn) - n_fit:,})"),
              ("line", FRONT, "fastest that fit"),
              (None, FRONT, "  (Pareto front)"),
              ("ring", CHOSEN, "first listed"),
              ("dash", USABLE, f"usable {usable / GB:.0f} GB"),
              (None, USABLE, f"  ({usable / hbm_bytes:.0%} of {hbm_bytes / GB:.0f} GB)")]
    if far:
        legend.append((None, USABLE, "  beyond the axis"))
    for k, (mark, rgb, s) in enumerate(legend):
        x, y = RIGHT + 28, TOP + 10 + 30 * k
        if mark == "square":
            c.rect(x + 6, y + 3, x + 13, y + 10, rgb)
        elif mark == "line":
            c.rect(x, y + 5, x + 20, y + 8, rgb)
            c.rect(x + 6, y + 2, x + 15, y + 11, rgb)
        elif mark == "ring":
            c.ring(x + 10, y + 7, 6, 9, rgb)
        elif mark == "dash":
            c.rect(x + 9, y - 2, x + 12, y + 5, rgb)
            c.rect(x + 9, y + 9, x + 12, y + 16, rgb)
        c.text(x + 28, y, s, BLACK if mark else rgb)
    n = len(estimates)
    notes = [f"{n:,} layout{'s' * (n > 1)} estimated; each point: one layout"]
    if len(drawn) < len(pts):
        notes.append(f"{len(pts) - len(drawn):,} layouts need over {x_max:g} GB per GPU: "
                     "not drawn (none fits)")
    for k, s in enumerate(notes):
        c.text(LEFT, BOTTOM + 72 + 24 * k, s[:88])
    return c, {"drawn": len(drawn), "left_out": len(pts) - len(drawn),
               "front": [i for _, _, i in front], "x_max_gb": x_max, "y_range_s": (lo, hi),
               "to_px": to_px}


def write(path, estimates, hbm_bytes, title="", usable_bytes=None):
    """Render the estimates (see render) and write the PNG to path; OSError if it cannot be
    written. Returns render's summary."""
    canvas, summary = render(estimates, hbm_bytes, title, usable_bytes)
    data = canvas.png()
    with open(path, "wb") as f:
        f.write(data)
    return summary
