"""The serial suite's launcher, settled before any test starts (tests/launcher.py)."""
import os
import shlex
from pathlib import Path

import pytest


def pytest_configure(config):
    named = os.environ.get("MINIDIST_MPIRUN")
    if not named:
        return
    words = shlex.split(named)
    if "/" in words[0] and not Path(words[0]).is_absolute():
        words[0] = str(Path(words[0]).resolve())
        os.environ["MINIDIST_MPIRUN"] = shlex.join(words)
    import launcher
    if not launcher.found(launcher.command()):
        raise pytest.UsageError(f"MINIDIST_MPIRUN names {words[0]}, which does not exist: "
                                "name your MPI's launcher, or unset it to use the mpirun beside this Python")
