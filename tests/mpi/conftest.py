"""Running pytest on many ranks at once: one summary, and no rank left waiting.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi

Every rank runs the same tests in the same order; a test talks to the other ranks
through COMM_WORLD (the `comm` fixture). What makes that workable:

1. Only rank 0 prints. The other ranks' terminal reporters are unregistered, so CI
   reads one closing "N passed" line, not N merged ones. Failures still reach stderr.
2. A failure anywhere ends the run at once. pytest catches a failed assertion, so
   sys.excepthook never sees it: the failing rank would go on to the next test while
   the others wait in the old one (or match its messages with the new one and pass
   falsely). The makereport hook below prints the failure and calls MPI_Abort.
3. Collection is agreed. A test module that fails to import on one rank (a missing
   file on one node) would leave that rank with fewer tests than the others, and
   rank 0's summary would not show the error. After collecting, every rank tells the
   others how many errors and tests it has (MPI's own Allgather); on any error, the
   lowest failing rank prints its errors and every rank stops with exit code 2; ranks
   that collected different tests stop too.
4. A test that deadlocks is ended: minidist's own watchdog (MINIDIST_TIMEOUT, 60 s here
   unless set) ends a wait inside minidist's communication with every rank's stack; a
   per-test timer (MINIDIST_TEST_TIMEOUT, default 120 s) ends any test, stuck anywhere,
   with this rank's stacks. faulthandler stands behind it, for a rank whose Python is
   stuck in C with the interpreter's lock held.
5. These reports reach the log. pytest captures stderr at the file-descriptor level
   while a test runs, and a report printed just before MPI_Abort was lost with the
   captured text. So every report goes to a copy of the real stderr, taken at start
   with pytest's capture suspended (failfast.report_to).

Without --only-mpi (or --with-mpi) this folder is skipped: `pytest tests` stays serial.
"""
import faulthandler
import os
import sys
import threading
import zlib

import pytest

TIMEOUT = float(os.environ.get("MINIDIST_TEST_TIMEOUT", "120"))
_real_stderr = {}
_collect_errors = []


_DESELECTED = {}      # file name -> why its tests do not run at this world size


def _under_mpi(config):
    return config.getoption("--only-mpi", False) or config.getoption("--with-mpi", False)


def pytest_ignore_collect(collection_path, config):
    """Outside mpirun this folder is not collected. Under mpirun, a test file that does not
    run at this world size (see pytest_collection_modifyitems) is not even imported: at 8
    ranks on 2 cores, importing a file's modules costs about as much as a small test. Its
    UP_TO_RANKS and WHY are read from its text."""
    if not _under_mpi(config):
        return True
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    from mpi4py import MPI
    size = MPI.COMM_WORLD.Get_size()
    why = _left_out(name, collection_path.read_text(), size)
    if why is None:
        return None
    _DESELECTED[name] = why
    return True


def _left_out(name, text, size):
    """Why the file `name` (whose source is `text`) does not run at `size` ranks, or None."""
    import ast
    import re
    if size > GRADED_AT and name.startswith("test_checks"):
        return f"grader checks are tested up to {GRADED_AT} ranks (tests/mpi/conftest.py)"
    m = re.search(r"^UP_TO_RANKS = (\d+)", text, flags=re.M)
    if m is None or size <= int(m.group(1)):
        return None
    w = re.search(r"^WHY = (\(.*?\)|\".*?\")$", text, flags=re.M | re.S)
    return f"runs up to {m.group(1)} ranks: {ast.literal_eval(w.group(1)) if w else '(no WHY given)'}"


@pytest.hookimpl(trylast=True)      # after pytest made its terminal reporter
def pytest_configure(config):
    if not _under_mpi(config):
        return
    os.environ.setdefault("MINIDIST_TIMEOUT", "60")   # read when minidist.comm starts its watchdog
    import minidist  # noqa: F401  (installs the fail-fast hooks for crashes outside tests)
    from minidist import failfast
    from mpi4py import MPI
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():    # fd 2 is the real stderr in here
            _real_stderr["file"] = os.fdopen(os.dup(2), "w", buffering=1)
        failfast.report_to(_real_stderr["file"])
    if MPI.COMM_WORLD.Get_rank() != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


GRADED_AT = 3    # the course map grades exercises at 3 and 4 ranks; at 4, tests/test_planted.py grades them


def pytest_collection_modifyitems(config, items):
    """The grader's checks run up to GRADED_AT ranks: above that they repeat what smaller
    worlds showed, at eight ranks' cost on two cores (exercise 01's cases include arrays of
    0 and 1 element, so some ranks' chunks are empty at 3 and 4 already). A test file that sets UP_TO_RANKS
    (and WHY, the reason) runs up to that world size: eight ranks add nothing it checks
    that 3 and 4 did not, and cost the most on a small machine.

    Such tests are deselected, not skipped: a skipped test still runs this file's per-test
    hooks on every rank (about 70 ms each at 8 ranks on 2 cores, 20 s for the suite); the
    reason is printed once per file after collection."""
    if not _under_mpi(config):
        return
    from mpi4py import MPI
    size = MPI.COMM_WORLD.Get_size()
    keep, dropped = [], []
    for item in items:
        name = item.path.name
        limit = getattr(item.module, "UP_TO_RANKS", None)
        if size > GRADED_AT and name.startswith("test_checks"):
            _DESELECTED.setdefault(name, f"grader checks are tested up to {GRADED_AT} ranks (tests/mpi/conftest.py)")
        elif limit is not None and size > limit:
            _DESELECTED.setdefault(name, f"runs up to {limit} ranks: {item.module.WHY}")
        else:
            keep.append(item)
            continue
        dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_report_collectionfinish(config, start_path, startdir=None, items=None):
    """One line per file left out at this world size, with its reason (rank 0 prints)."""
    return [f"not at this world size: {name}: {why}" for name, why in sorted(_DESELECTED.items())]


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append(f"ERROR collecting {report.nodeid or '.'}\n{report.longreprtext}")


def pytest_collection_finish(session):
    """Agree on collection: errors on any rank, or different tests, stop every rank."""
    if not _under_mpi(session.config):
        return
    import numpy as np
    from mpi4py import MPI
    from minidist import failfast
    from minidist.comm.watchdog import waiting
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    if size == 1:
        return
    names = "\n".join(item.nodeid for item in session.items).encode()
    mine = np.array([len(_collect_errors), len(session.items), zlib.crc32(names)], np.int64)
    table = np.empty((size, 3), np.int64)
    with waiting("pytest's collection agreement"):
        world.Allgather(mine, table)
    failing = [r for r in range(size) if table[r, 0]]
    if failing:
        if rank == failing[0]:
            failfast.say("\n".join(_collect_errors))
        pytest.exit(f"collection failed on rank(s) {', '.join(map(str, failing))}", returncode=2)
    if len({tuple(row[1:]) for row in table}) > 1:
        counts = ", ".join(f"rank {r}: {table[r, 1]}" for r in range(size))
        pytest.exit(f"the ranks collected different tests ({counts} tests)", returncode=2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_size() > 1:
            from minidist.failfast import report_and_abort
            report_and_abort(f"FAILED {report.nodeid} (in {report.when})\n{report.longreprtext}")


def _too_long(nodeid):
    """The per-test timer fired: print this rank's stacks, end the job."""
    from minidist import failfast
    from minidist.comm import watchdog
    failfast.say(f"{nodeid} has run for {TIMEOUT:g} s (MINIDIST_TEST_TIMEOUT): a deadlock?\n"
                 f"{watchdog.where()}\n{watchdog.stacks()}")
    failfast.report_and_abort(f"{nodeid} did not finish within {TIMEOUT:g} s")
    os._exit(1)                       # one rank alone: nothing to abort


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timer = threading.Timer(TIMEOUT, _too_long, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    # the last resort, for a rank stuck in C with Python's lock held: C-level stacks
    faulthandler.dump_traceback_later(TIMEOUT + 15, exit=True,
                                      file=_real_stderr.get("file") or sys.stderr)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def comm():
    """COMM_WORLD, after a barrier: a test starts only when every rank has finished the last."""
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
    return MPI.COMM_WORLD
