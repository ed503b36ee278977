"""What the grader's command (command.py) and the teacher's form (classroom.py) both use:
the exercises' checks, the rank counts each is graded at, how a verdict line is folded,
and the variable that marks a job the form started.

Both import it; it imports neither, so the grader's modules import one way (this
project's own layering).
"""
import importlib
import textwrap
from pathlib import Path

CHECKS = Path(__file__).parent / "checks"
IN_JOB = "MINIDIST_GRADE_IN_JOB"     # set in the jobs the teacher's form starts: grade there,
                                     # launch nothing


def fold(line, width=100):
    """One verdict as printed: lines of at most `width` columns (a word longer than that
    stays whole), the ones after the first indented; --json keeps the message in one piece."""
    return textwrap.fill(line, width, subsequent_indent=" " * 6, break_long_words=False,
                         break_on_hyphens=False)


def known_exercises():
    """{"00": "00_autograd", ...} from minidist/grader/checks/exNN_topic.py."""
    return {p.stem[2:4]: p.stem[2:] for p in sorted(CHECKS.glob("ex[0-9][0-9]_*.py"))}


def checks_for(exercise):
    return importlib.import_module(f"minidist.grader.checks.ex{exercise}").EXERCISES


def exercise_ranks(ex, siblings=()):
    """The rank counts one exercise is graded at: 3 and 4 when it needs a ring of at least
    3 (3 is odd, so chunks are uneven), or when its plug-in check runs the lesson on every
    rank of the job (the ring of its file's exercises: 2.2, 3.5, 4.1, ...); else the ranks
    its lesson run needs (4 for lesson 07's grids); else one process (a serial check and a
    lesson run in one process: 00, 08, 9.1, 10.1 to 10.4 start no MPI job)."""
    lesson = max((r.ranks for r in ex.runs), default=0)
    ring = max([ex.min_ranks] + [e.min_ranks for e in siblings])
    if ex.min_ranks > 1 or (ring > 1 and any(r.ranks == 0 for r in ex.runs)):
        return (max(ring, lesson), max(ring, lesson) + 1)
    return (lesson,) if lesson > 1 else (1,)
