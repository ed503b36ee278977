"""minidist.progress: plain lines off a terminal, one rewritten line with the time left on one."""
import io

from minidist.progress import Progress, clock


class Tty(io.StringIO):
    def isatty(self):
        return True


def ticks(values):
    it = iter(values)
    return lambda: next(it)


def test_plain_lines_every_tenth_and_the_last():
    out = io.StringIO()
    bar = Progress(20, "training", stream=out, clock=ticks(range(100)))
    for i in range(20):
        bar.update(i + 1, "loss 1.0")
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue()
    assert lines[0].startswith("training  2/20  loss 1.0  ~ ")
    assert lines[-1].startswith("training  20/20  loss 1.0  done in ")


def test_terminal_line_rewritten_with_time_left():
    out = Tty()
    # start at 0; after 1 of 4 items 10 s have passed: 30 s left
    bar = Progress(4, "steps", stream=out, clock=ticks([0, 10, 20, 30, 40]))
    bar.update(1)
    assert out.getvalue().startswith("\rsteps  1/4  ~ 0:30 left")
    for i in (2, 3, 4):
        bar.update(i)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and "done in 0:40" in text
    assert all(len(part.rstrip("\n")) <= 100 for part in text.split("\r"))


def test_clock_reads_minutes_and_hours():
    got = [clock(s) for s in (0, 59.6, 75, 3725, -3)]
    assert got == ["0:00", "1:00", "1:15", "1:02:05", "0:00"]
