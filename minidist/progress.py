"""One progress line for long work: an updating line with the time left on a terminal, plain
lines otherwise (a log file, a pipe, a test).

    bar = Progress(total=200, label="training")
    for step in range(200):
        ...
        bar.update(step + 1, f"loss {loss:.3f}")
    bar.close()

On a terminal (stream.isatty()) each update rewrites one line, "training  120/200  loss 2.314
 ~ 0:41 left", the time left estimated from the rate so far. Otherwise an update prints a plain
line only every `every` items (and the last), without the carriage return, so a log holds
readable lines. Only rank 0 of an MPI job should make one (the caller decides). Lines are cut
to 100 columns.
"""
import sys
import time

WIDTH = 100


def clock(seconds):
    """Seconds as a clock reads: 75 -> '1:15', 3725 -> '1:02:05' (rounded to the second)."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total, label, stream=None, every=None, clock=time.monotonic):
        self.total, self.label = max(1, int(total)), label
        self.stream = sys.stdout if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else max(1, self.total // 10)
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.open = False       # a terminal line is showing and not yet ended

    def line(self, done, text=""):
        """The line for `done` of total items: label, count, text and, once one item is done,
        the time left at the rate so far."""
        elapsed = self.clock() - self.start
        parts = [self.label, f"{done}/{self.total}"]
        if text:
            parts.append(text)
        if 0 < done < self.total:
            parts.append(f"~ {clock(elapsed * (self.total - done) / done)} left")
        elif done >= self.total:
            parts.append(f"done in {clock(elapsed)}")
        return "  ".join(parts)[:WIDTH]

    def update(self, done, text=""):
        self.done = done
        s = self.line(done, text)
        if self.tty:
            self.stream.write("\r" + s.ljust(WIDTH - 1)[:WIDTH - 1])
            self.open = True
            if done >= self.total:
                self.close()
        elif done % self.every == 0 or done >= self.total:
            self.stream.write(s + "\n")
        self.stream.flush()

    def close(self):
        """End a terminal line (the next print starts on a new line); nothing otherwise."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
