"""The launcher a user names reaches the tests that start ranks (tests/launcher.py): the
suite run with MINIDIST_MPIRUN set to a wrapper starts its jobs through the wrapper, and a
launcher that does not exist stops the run with one message instead of skipping tests."""
import os
import subprocess
import sys
from pathlib import Path

from launcher import logging_launcher, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]


def pytest_run(env, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


@needs_mpirun
def test_the_tests_start_their_jobs_with_the_named_launcher(tmp_path):
    wrapper, log = logging_launcher(tmp_path)
    env = dict(os.environ, MINIDIST_MPIRUN=str(wrapper), OMP_NUM_THREADS="1")
    proc = pytest_run(env, "tests/test_lessons.py", "-k", "says_it_is_single_process or trace_into_a_missing_folder")
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout + proc.stderr
    started = log.read_text().splitlines()
    assert len(started) == 2 and all(line.startswith(("-n 3 ", "-n 2 ")) for line in started), started


def test_a_named_launcher_that_does_not_exist_stops_the_run():
    env = dict(os.environ, MINIDIST_MPIRUN="/no/such/mpirun --oversubscribe")
    proc = pytest_run(env, "tests/test_lessons.py")
    assert proc.returncode != 0 and "passed" not in proc.stdout and "skipped" not in proc.stdout, proc.stdout
    assert "MINIDIST_MPIRUN names /no/such/mpirun, which does not exist" in proc.stdout + proc.stderr
