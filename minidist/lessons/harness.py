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

The machinery lives below lessons/, where bench and the grader use it too:
minidist/cli.py (printing on rank 0, flags, InputError, `run`), minidist/report.py (the
report and its JSON) and minidist/equivalence.py (`compare`, `TOLERANCE`). This module
gathers their names for the lessons, as `harness.X`, and adds what only lessons need.
"""
import os

from minidist.cli import (EXIT_INPUT, WIDTH, Captured, InputError, add_output,  # noqa: F401
                          agreed_need, captured, comm_world, command_with, fit, fmt_bytes,
                          is_root, json_problem, need, nonnegative_float, nonnegative_int, parser,
                          positive_float, positive_int, ranks, run, running, say, table, world)
from minidist.equivalence import TOLERANCE, compare, rel_diff  # noqa: F401
from minidist.report import REPORT_KEYS, finish, new_report  # noqa: F401


def single_process(lesson):
    """InputError on every rank when a one-process lesson is started on several ranks.

    Training N identical copies would only waste N-1 processes and print N-fold; the
    lesson says so once and every rank exits 2.
    """
    n = world()[1]
    need(n == 1, f"{lesson} is a single-process lesson: run it without mpirun (or with -n 1), "
                 f"not on {n} ranks")


def heads_fix(n_head, n_embd, tp=1):
    """The flags that give whole heads to each of tp ranks and whole channels to each head:
    the next multiple of tp heads, and n_embd rounded to a multiple of that ({} if both hold)."""
    h = -(-n_head // tp) * tp
    e = n_embd if n_embd % h == 0 else h * max(1, round(n_embd / h))
    return {k: v for k, v, old in (("--n-head", h, n_head), ("--n-embd", e, n_embd)) if v != old}


def physical_memory():
    """Bytes of memory this machine has, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def env_threads():
    """The BLAS thread count this process was started with (for the report's footnote)."""
    return os.environ.get("OMP_NUM_THREADS", "unset")
