"""The MPI launcher the serial tests start their jobs with.

MINIDIST_MPIRUN names it, split into words as a shell would (`mpirun --oversubscribe`);
the Makefile passes its MPIRUN there, so `make test MPIRUN=...` reaches every test that
starts ranks, and the grader's class jobs use the same variable. Without it: the mpirun
beside this Python (the .venv's wheel). tests/conftest.py makes a relative path absolute
(tests start jobs from temporary folders) and stops the run when a named launcher does
not exist: a launcher the user named is never skipped silently.
"""
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest

ENV = "MINIDIST_MPIRUN"


def command():
    """The launcher as a list of words, or None when there is none."""
    named = os.environ.get(ENV)
    if named:
        return shlex.split(named)
    beside = Path(sys.executable).with_name("mpirun")
    return [str(beside)] if beside.exists() else None


def found(words):
    return words is not None and (Path(words[0]).is_file() or shutil.which(words[0]) is not None)


MPIRUN = command()
HAVE = found(MPIRUN)
NO_LAUNCHER = f"no MPI launcher: no mpirun beside {sys.executable} and {ENV} not set"
needs_mpirun = pytest.mark.skipif(not HAVE, reason=NO_LAUNCHER)


def mpirun_cmd(n):
    """The words that start an n-rank job: [*launcher, '-n', n]."""
    if not HAVE:
        pytest.skip(NO_LAUNCHER)
    return [*MPIRUN, "-n", str(n)]


def our_lines(text):
    """The non-empty lines the job itself printed: without the launcher's own report of a
    non-zero exit (Open MPI frames it between lines of dashes; MPICH adds none)."""
    lines, inside = [], False
    for line in text.splitlines():
        if set(line.strip()) == {"-"} and len(line.strip()) >= 40:
            inside = not inside
        elif not inside and line.strip():
            lines.append(line)
    return lines


def logging_launcher(folder):
    """(a launcher script in folder that notes its arguments and starts the real one, the log)."""
    log, script = folder / "launched.txt", folder / "my-mpirun"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {log}\nexec {shlex.join(MPIRUN)} \"$@\"\n")
    script.chmod(0o755)
    return script, log
