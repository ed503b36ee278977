"""What every lesson shares: flags, printing on rank 0, comparison, the report, clean errors.

A lesson is one story: parse flags, run the single-process reference and the parallel
run from the same seed and global batch, compare loss, gradients and weights, print a
report a student can read, and exit 0 only on a match. The shape of a lesson module:

    def main(args):
        ...
        return harness.finish(report, args)

    if __name__ == "__main__":
        harness.run(main, parser)

Bad input (a flag value that cannot work, a world size that does not fit, a missing
file) is an `InputError`: every rank finds it alike, rank 0 prints one line, every
rank exits 2. Anything else is a bug, and the fail-fast hook ends the whole job.
"""
import argparse
import json
import os
import sys

import numpy as np

from minidist.failfast import agreed_exit

EXIT_INPUT = 2  # bad input: the same code argparse uses


class InputError(Exception):
    """Input that cannot work. Raise it on every rank alike (or agree on it first)."""


def world():
    """(rank, size) of COMM_WORLD; (0, 1) when MPI is not importable."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def is_root():
    return world()[0] == 0


def say(*parts, **kw):
    """print() on rank 0 only, flushed so lines from a job appear in order."""
    if is_root():
        print(*parts, **kw, flush=True)


def table(rows, header=None, indent="  "):
    """Print rows (lists of cells) as aligned text columns on rank 0."""
    rows = [[str(c) for c in r] for r in ([header] if header else []) + list(rows)]
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    for n, r in enumerate(rows):
        say(indent + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if header and n == 0:
            say(indent + "  ".join("-" * w for w in widths))


def fmt_bytes(n):
    """1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


# ----------------------------------------------------------------------------- flags

class _Parser(argparse.ArgumentParser):
    """argparse whose errors print once (rank 0) and exit 2 on every rank."""

    def error(self, message):
        if is_root():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        agreed_exit(EXIT_INPUT)

    def exit(self, status=0, message=None):  # --help prints once too
        if message and is_root():
            print(message, file=sys.stderr, flush=True)
        agreed_exit(status)

    def print_help(self, file=None):
        if is_root():
            super().print_help(file)


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def parser(description, steps=3, dtype="float64"):
    """The flags every lesson takes; a lesson adds its own to what this returns.

    steps=None: a lesson that does not train has no --steps.
    """
    p = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if steps is not None:
        p.add_argument("--steps", type=positive_int, default=steps, help="training steps (default %(default)s)")
    p.add_argument("--dtype", choices=["float32", "float64"], default=dtype,
                   help="float64 checks exactness, float32 is the speed case (default %(default)s)")
    p.add_argument("--seed", type=int, default=1337, help="seed for weights and batches")
    p.add_argument("--json", metavar="PATH", help="write the lesson's report as JSON on rank 0")
    return p


# ----------------------------------------------------------------------------- comparison

# Tolerances on max_rel_diff (per tensor: max|a-b| / max|b|). float64 sums in another
# order differ in the last bits (~1e-16 relative) and a few steps of training amplify
# that a little; 1e-10 leaves a margin of a million while still catching any real bug.
# float32 carries ~6e-8 relative rounding per op; after a few AdamW steps (which divide
# by sqrt(v), amplifying small-gradient noise) parallel and serial orders differ by up
# to ~1e-4 on individual tensors (data parallel, 3 steps: 3e-5 to 1.2e-4 measured at 3
# and 4 ranks), so float32 is held to 1e-3.
TOLERANCE = {"float64": 1e-10, "float32": 1e-3}


def rel_diff(a, b):
    """(max|a-b| / max|b|, max|a-b|) for one tensor; (0, 0) when both are all zero.

    A NaN or inf on either side is infinitely wrong, never quietly skipped.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0, 0.0
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf"), float("inf")
    abs_diff = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b)))
    if scale == 0.0:
        return (0.0 if abs_diff == 0.0 else float("inf")), abs_diff
    return abs_diff / scale, abs_diff


def compare(parallel, reference):
    """Compare two {name: array} dicts tensor by tensor.

    Returns (max_rel_diff, max_abs_diff, worst_name). A name missing from one side is a
    mismatch (inf), never silently skipped.
    """
    worst_rel, worst_name, max_abs = 0.0, None, 0.0
    for name in sorted(set(parallel) | set(reference)):
        if name not in parallel or name not in reference:
            return float("inf"), float("inf"), name
        r, a = rel_diff(parallel[name], reference[name])
        max_abs = max(max_abs, a)
        if worst_name is None or r > worst_rel:
            worst_rel, worst_name = r, name
    return worst_rel, max_abs, worst_name


# ----------------------------------------------------------------------------- report

REPORT_KEYS = ("lesson", "world_size", "parallel", "dtype", "steps", "match", "max_rel_diff",
               "max_abs_diff", "tolerance", "losses", "comm", "memory", "step_time_s", "mfu")


def new_report(lesson, args, **fields):
    """A report with every key of the architecture's contract, None where not set."""
    rep = dict.fromkeys(REPORT_KEYS)
    rep.update(lesson=lesson, world_size=world()[1], dtype=getattr(args, "dtype", None),
               steps=getattr(args, "steps", None))
    for k, v in fields.items():
        if k not in REPORT_KEYS:
            raise KeyError(f"{k!r} is not a report key; the keys are {REPORT_KEYS}")
        rep[k] = v
    return rep


def _plain(x):
    """NumPy scalars and arrays -> JSON-friendly Python values; inf/nan -> None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if np.isfinite(x) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def finish(report, args):
    """Print the verdict, write --json on rank 0, return the exit code (0 only on a match)."""
    match = bool(report.get("match"))
    tol = report.get("tolerance")
    rel = report.get("max_rel_diff")
    if rel is not None:
        verdict = "MATCH" if match else "MISMATCH"
        tol_txt = f" (tolerance {tol:.0e})" if tol is not None else ""
        say(f"\nverdict: {verdict}: max_rel_diff {rel:.3e}{tol_txt}")
    else:
        say(f"\nverdict: {'MATCH' if match else 'MISMATCH'}")
    path = getattr(args, "json", None)
    if path and is_root():
        with open(path, "w") as f:
            json.dump(_plain(report), f, indent=2)
            f.write("\n")
        say(f"report written to {path}")
    return 0 if match else 1


def run(main, p):
    """Parse flags, run main(args) and exit with its code; InputError -> one line, exit 2."""
    args = p.parse_args()
    try:
        if getattr(args, "json", None):  # found now, not after the whole run
            folder = os.path.dirname(os.path.abspath(args.json))
            need(os.path.isdir(folder) and os.access(folder, os.W_OK),
                 f"--json {args.json}: the folder {folder} does not exist or is not writable")
        code = main(args)
    except InputError as e:
        say(f"error: {e}", file=sys.stderr)
        sys.stdout.flush()
        agreed_exit(EXIT_INPUT)
    sys.stdout.flush()
    agreed_exit(code or 0)


def need(ok, message):
    """Raise InputError(message) unless ok (the condition must be the same on every rank)."""
    if not ok:
        raise InputError(message)


def agreed_need(comm, ok, message):
    """Like need(), for a condition that may differ between ranks (a file seen by one node).

    One small all-reduce: every rank learns whether all were fine, and all raise together.
    """
    from minidist.comm import agree
    if not agree(comm, bool(ok)):
        raise InputError(message if not ok else f"{message} (found on another rank)")


def env_threads():
    """The BLAS thread count this process was started with (for the report's footnote)."""
    return os.environ.get("OMP_NUM_THREADS", "unset")
