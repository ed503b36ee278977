"""Running pytest on many ranks at once: one summary, and no rank left waiting.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi

Every rank runs the same tests in the same order; a test talks to the other ranks
through COMM_WORLD (the `comm` fixture). Three things make that workable:

1. Only rank 0 prints. The other ranks' terminal reporters are unregistered, so CI
   reads one closing "N passed" line, not N merged ones. Failures still reach stderr.
2. A failure anywhere ends the run at once. pytest catches a failed assertion, so
   sys.excepthook never sees it: the failing rank would go on to the next test while
   the others wait in the old one (or match its messages with the new one and pass
   falsely). The makereport hook below prints the failure and calls MPI_Abort.
3. A test that deadlocks (a ring step that never gets its partner) is ended by a
   watchdog after MINIDIST_TEST_TIMEOUT seconds (default 120), with every thread's
   stack dumped, and mpirun then ends the other ranks.

Without --only-mpi (or --with-mpi) this folder is skipped: `pytest tests` stays serial.
"""
import faulthandler
import os

import pytest

TIMEOUT = float(os.environ.get("MINIDIST_TEST_TIMEOUT", "120"))


def _under_mpi(config):
    return config.getoption("--only-mpi", False) or config.getoption("--with-mpi", False)


def pytest_ignore_collect(collection_path, config):
    if not _under_mpi(config):
        return True
    return None


@pytest.hookimpl(trylast=True)      # after pytest made its terminal reporter
def pytest_configure(config):
    if not _under_mpi(config):
        return
    import minidist  # noqa: F401  (installs the fail-fast hooks for crashes outside tests)
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_size() > 1:
            from minidist.failfast import report_and_abort
            report_and_abort(f"FAILED {report.nodeid} (in {report.when})\n{report.longreprtext}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(TIMEOUT, exit=True)     # the deadlock watchdog
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def comm():
    """COMM_WORLD, after a barrier: a test starts only when every rank has finished the last."""
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
    return MPI.COMM_WORLD
