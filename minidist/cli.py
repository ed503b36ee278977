"""The command line every program of minidist shares: rank 0 speaks, flags fail cleanly.

Lessons, `python -m minidist.bench` and the grader's runs all parse their flags and print
through here: `say` prints on rank 0 of the program's communicator, the flag types refuse a
value with one line naming what was expected, and bad input (a flag value that cannot work,
a world size that does not fit, a missing file) is an `InputError`: every rank finds it
alike, rank 0 prints one line, every rank exits 2. Anything else is a bug, and the fail-fast
hook ends the whole job. The report a lesson ends with and its JSON are minidist/report.py.

    p = cli.parser("what the program does")      # --steps, --dtype, --seed, --json
    p.add_argument("--iters", type=cli.positive_int, default=10)
    cli.run(main, p)                              # main(args) -> exit code
"""
import argparse
import math
import os
import sys
import threading
from contextlib import contextmanager

import numpy as np

from minidist.failfast import agreed_exit

EXIT_INPUT = 2  # bad input: the same code argparse uses


class InputError(Exception):
    """Input that cannot work. Raise it on every rank alike (or agree on it first)."""


# ----------------------------------------------------------------------------- rank 0 speaks

_here = threading.local()        # .comm and .captured while the grader runs a lesson (running())


class Captured:
    """What a lesson run under `running` said: its reports and its printed lines (rank 0)."""

    def __init__(self):
        self.reports, self.lines = [], []


def captured():
    """The Captured of the lesson `running` runs in this thread, or None (a plain run)."""
    return getattr(_here, "captured", None)


def comm_world():
    """The communicator a lesson runs on: COMM_WORLD, or the one `running` chose.
    With MINIDIST_LINKS set, COMM_WORLD under minidist/comm/links.py's link model."""
    comm = getattr(_here, "comm", None)
    if comm is not None:
        return comm
    from minidist.comm.links import from_environment
    return from_environment()      # COMM_WORLD; its sends delayed when MINIDIST_LINKS is set


@contextmanager
def running(comm):
    """Run a lesson's main() in this thread on `comm` (not COMM_WORLD), silently; yields
    a Captured: the reports report.finish made and the lines `say` would have printed.

    The grader's plug-in check runs lessons this way: on the ranks it chose (a group of
    the job, or one rank alone for a one-process lesson), printing nothing.
    """
    _here.comm, _here.captured = comm, Captured()
    try:
        yield _here.captured
    finally:
        _here.comm = _here.captured = None


def world():
    """(rank, size) of the lesson's communicator; (0, 1) when MPI is not importable."""
    if getattr(_here, "comm", None) is None:
        try:
            from mpi4py import MPI    # noqa: F401
        except ImportError:
            return 0, 1
    comm = comm_world()
    return comm.Get_rank(), comm.Get_size()


def is_root():
    return world()[0] == 0


def say(*parts, **kw):
    """print() on rank 0 only, flushed so lines from a job appear in order."""
    said = captured()
    if said is not None:
        if is_root():
            said.lines += " ".join(map(str, parts)).splitlines()
        return
    if is_root():
        wrap = kw.get("file") in (None, sys.stdout)      # errors (stderr) stay one line each
        try:
            print(*(fit(p) if wrap and isinstance(p, str) else p for p in parts), **kw, flush=True)
        except BrokenPipeError:       # `... | head` stopped reading: finish the lesson quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), (kw.get("file") or sys.stdout).fileno())


WIDTH = 100     # the widest line a lesson prints: a class reads it in any terminal


def fit(text, width=WIDTH):
    """Wrap each line of text wider than `width` at spaces, continuing at its own indent.

    A net for shapes and flags the lessons' own line breaks did not foresee; MINIDIST_NO_WRAP=1
    turns it off, so that tests/test_output_width.py sees the lines as the lessons build them.
    """
    if all(len(line) <= width for line in text.split("\n")) or os.environ.get("MINIDIST_NO_WRAP") == "1":
        return text
    import textwrap
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line.lstrip(), width, initial_indent=indent, subsequent_indent=indent,
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def table(rows, header=None, indent="  "):
    """Print rows (lists of cells) as aligned text columns on rank 0."""
    rows = [[str(c) for c in r] for r in ([header] if header else []) + list(rows)]
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    for n, r in enumerate(rows):
        say((indent + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))).rstrip())
        if header and n == 0:
            say((indent + "  ".join("-" * w for w in widths)).rstrip())


def ranks(n):
    """3 -> '3 ranks', 1 -> '1 rank'."""
    return f"{n} rank{'' if n == 1 else 's'}"


def fmt_bytes(n):
    """1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


# ----------------------------------------------------------------------------- bad input

def need(ok, message):
    """Raise InputError(message) unless ok (the condition must be the same on every rank)."""
    if not ok:
        raise InputError(message)


def command_with(world, changes=None):
    """The command that started this program, on `world` ranks and with the flags in `changes`
    ({"--n-head": 9}) replaced or added: a hint a student can paste, and it runs."""
    import __main__
    spec = getattr(__main__, "__spec__", None)
    module = spec.name if spec is not None else os.path.basename(sys.argv[0])
    argv, changes = list(sys.argv[1:]), dict(changes or {})
    for flag, value in changes.items():
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                argv[i + 1] = str(value)
                break
            if a.startswith(flag + "="):
                argv[i] = f"{flag}={value}"
                break
        else:
            argv += [flag, str(value)]
    words = (["mpirun", "-n", str(world)] if world > 1 else []) + ["python", "-m", module] + argv
    return " ".join(words)


def agreed_need(comm, ok, message):
    """Like need(), for a condition that may differ between ranks (a file seen by one node).

    One small all-reduce: every rank learns whether all were fine, and all raise together.
    """
    from minidist.comm import agree
    if not agree(comm, bool(ok)):
        raise InputError(message if not ok else f"{message} (found on another rank)")


# ----------------------------------------------------------------------------- flags

class _Parser(argparse.ArgumentParser):
    """argparse whose errors print one line once (rank 0) and exit 2 on every rank."""

    def error(self, message):
        if is_root():                  # one line, as the lessons promise; the usage is under --help
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        agreed_exit(EXIT_INPUT)

    def exit(self, status=0, message=None):  # --help prints once too
        if message and is_root():
            print(message, file=sys.stderr, flush=True)
        agreed_exit(status)

    def print_help(self, file=None):
        if is_root():
            super().print_help(file)


def _number(text, kind):
    """text -> int or float, or an argparse error that names what was expected."""
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}")
    if kind is float and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def positive_int(text):
    """argparse type: a whole number >= 1 (steps, sizes, repeats)."""
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def nonnegative_int(text):
    """argparse type: a whole number >= 0 (a seed; an interval where 0 means never)."""
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v}")
    return v


def nonnegative_float(text):
    """argparse type: a finite number >= 0 (a clipping norm where 0 means off)."""
    v = _number(text, float)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v:g}")
    return v


def positive_float(text):
    """argparse type: a finite number > 0 (a learning rate, a size in MiB, a peak TFLOP/s)."""
    v = _number(text, float)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {v:g}")
    return v


def parser(description, steps=3, dtype="float64"):
    """The flags every lesson takes (and bench, with steps=None); a program adds its own.

    steps=None: a program that does not train has no --steps; dtype=None: one that computes
    no arrays (a planner in Python numbers) has no --dtype.
    """
    p = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if steps is not None:
        p.add_argument("--steps", type=positive_int, default=steps, help="training steps (default %(default)s)")
    if dtype is not None:
        p.add_argument("--dtype", choices=["float32", "float64"], default=dtype,
                       help="float64 checks exactness, float32 is the speed case "
                            "(default %(default)s)")
    p.add_argument("--seed", type=nonnegative_int, default=1337, help="seed for weights and batches (0 or more)")
    add_output(p, "--json", help="write the lesson's report as JSON on rank 0")
    return p


def add_output(p, flag, help):
    """A flag naming a file the program writes (--json, --trace): checked before `run` starts main."""
    action = p.add_argument(flag, metavar="PATH", help=help)
    p.outputs = getattr(p, "outputs", []) + [(flag, action.dest)]


def json_problem(path, flag="--json"):
    """Why the file `path` (given to `flag`) cannot be written, or None when it can.

    Found before the run, not after it: a folder given as the file, a missing or
    read-only folder, a file that exists but cannot be written (tried by opening it to
    append, which changes nothing: permission bits alone do not bind a superuser).
    """
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        return f"{flag} {path}: that is a folder; give a file name, e.g. {os.path.join(path, 'report.json')}"
    if not os.path.isdir(folder):
        return f"{flag} {path}: the folder {folder} does not exist"
    if os.path.exists(full):
        try:                       # opening to append changes nothing in the file
            open(full, "a").close()
        except OSError as e:
            return f"{flag} {path}: the file exists and cannot be written ({e.strerror})"
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {path}: the folder {folder} is not writable"
    return None


def _root_decides(problem):
    """Rank 0's verdict on something only rank 0 does (writing --json), known on every rank."""
    if world()[1] == 1:
        return problem
    text = np.frombuffer((problem or "").encode(), dtype=np.uint8)
    n = np.array([len(text) if problem is not None else -1], dtype=np.int64)
    comm_world().Bcast(n, root=0)                # its length (-1: no problem), then its bytes
    buf = text.copy() if is_root() else np.empty(max(int(n[0]), 0), dtype=np.uint8)
    comm_world().Bcast(buf, root=0)
    return None if n[0] < 0 else buf.tobytes().decode()


def run(main, p):
    """Parse flags, run main(args) and exit with its code; InputError -> one line, exit 2."""
    args = p.parse_args()
    try:
        for flag, dest in getattr(p, "outputs", []):   # found now, not after the whole run
            if getattr(args, dest, None):
                problem = _root_decides(json_problem(getattr(args, dest), flag) if is_root() else None)
                need(problem is None, problem)
        code = main(args)
    except InputError as e:
        say(f"error: {e}", file=sys.stderr)
        sys.stdout.flush()
        agreed_exit(EXIT_INPUT)
    sys.stdout.flush()
    agreed_exit(code or 0)
