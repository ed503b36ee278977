"""Checks for the exercises in lessons/exercises/, one module per exercise file.

`lessons/exercises/NN_topic.py` is graded by `minidist.grader.checks.exNN_topic`, whose
`EXERCISES` lists what to check. A check takes the function to grade (the student's, or
the package's own in the tests) and raises AssertionError with a plain sentence when it
is wrong; it returns None when it is right.

A check of a multi-rank exercise (min_ranks > 1) also takes a `session`
(minidist.grader.counting.Session): the grader makes one on every rank before
the check's thread starts, so that it can stop the thread when another rank fails. The
tests call such checks without one, and the check makes its own. Such a check raises on
the rank that sees the problem, and only there: the grader agrees the verdicts.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Exercise:
    number: str                 # "0.1": what the stub's NotImplementedError names
    name: str                   # the function's name, in the stub file and in the package
    reference: Callable         # the package's own answer
    check: Callable             # check(fn) or check(fn, session) -> None, raises AssertionError
    min_ranks: int = 1          # the grader fails the exercise below this many ranks (1: serial)
    groups: bool = False        # the check also needs session.sub: groups of N-1 ranks and 1 (counting.Session)
    why_ranks: str = ("at 2 ranks a ring's left and right neighbours are the same rank, so a wrong "
                      "neighbour would pass;")   # why min_ranks, for the refusal below it
    runs: tuple = ()            # the plug-in check's lesson settings (minidist.grader.plugin.Run)


@contextmanager
def own_session(session, split=False):
    """The grader's session, or (called from a test) a new one, freed afterwards."""
    if session is not None:
        yield session
        return
    from minidist.grader.counting import Session
    session = Session(split=split)
    try:
        yield session
    finally:
        session.free()


def yours(fn, *args):
    """fn(*args); an AssertionError from the student's own code is said to be theirs, not
    taken for a check's finding (the grader's own, a Misuse, passes as it is)."""
    from minidist.grader.referee import where
    try:
        return fn(*args)
    except AssertionError as e:
        if type(e) is not AssertionError:
            raise
        raise AssertionError(f"your code's assert failed{': ' + str(e) if str(e) else ''}{where(e)} "
                             "(an assert in your function, not the grader's check)") from None


def world_then_groups(s, cases):
    """Run cases(session) on the world, then on groups of another size (ranks 0 .. N-2, and
    rank N-1 alone): code with N written into it (n = 4, / 4) is right at one size only.
    The session must have its groups: Session(split=True), Exercise(groups=True)."""
    from minidist.grader.referee import said, where as where_in_student
    cases(s)
    if s.sub is None:
        raise AssertionError("this check needs the session's groups (Session(split=True))")
    g = s.group
    where = (f"in a communicator of {len(g)} ranks (world ranks {g[0]}..{g[-1]}, its ranks 0..{len(g) - 1})"
             if len(g) > 1 else f"alone in a communicator of size 1 (world rank {g[0]}, its rank 0)")
    try:
        cases(s.sub)
    except Exception as e:        # a Misuse stays a Misuse; MPI's "invalid rank" becomes words
        kind = type(e) if isinstance(e, AssertionError) else AssertionError
        text = str(e) if isinstance(e, AssertionError) else f"{said(e)}{where_in_student(e)}"
        raise kind(f"{where}, after passing on all {s.size()} ranks: {text} (take N from "
                   "comm.Get_size(), never from a number written in the code)") from None
