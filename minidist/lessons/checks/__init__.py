"""Checks for the exercises in lessons/exercises/, one module per exercise file.

`lessons/exercises/NN_topic.py` is graded by `minidist.lessons.checks.exNN_topic`, whose
`EXERCISES` lists what to check. A check takes the function to grade (the student's, or
the package's own in the tests) and raises AssertionError with a plain sentence when it
is wrong; it returns None when it is right.
"""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Exercise:
    number: str                 # "0.1": what the stub's NotImplementedError names
    name: str                   # the function's name, in the stub file and in the package
    reference: Callable         # the package's own answer
    check: Callable             # check(fn) -> None, raises AssertionError("plain words")
