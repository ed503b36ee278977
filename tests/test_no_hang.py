"""No hang, whatever a rank does: every way one rank can leave (or never come) ends the job.

Each test launches a small script under `mpirun -n 4` in a subprocess with a hard
timeout and checks that the job ends non-zero, in bounded time, naming the rank and the
reason. The waits are shortened (MINIDIST_EXIT_TIMEOUT=2, or 1 where a rank simply
leaves; MINIDIST_TIMEOUT=3) so the file runs in about a minute; without the fail-fast each of these jobs hangs forever.
Runs in the serial suite (`pytest tests`), never under mpirun itself.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 20           # seconds: the bound for one rank's exit to end the job
HARD = 90            # the subprocess is killed after this, so a regression fails, never hangs

pytestmark = needs_mpirun

HEAD = """
import sys
import numpy as np
import minidist
from mpi4py import MPI
from minidist.comm import ProcessGrid, all_reduce, ring_all_reduce
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
"""


def run(tmp_path, body, ranks=4, exit_timeout="2", timeout="30", args=None, **more_env):
    """Run HEAD + body on `ranks` ranks; returns (returncode, stdout + stderr, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(HEAD + textwrap.dedent(body))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MINIDIST_EXIT_TIMEOUT=exit_timeout, MINIDIST_TIMEOUT=timeout,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in more_env.items()})
    start = time.perf_counter()
    try:
        proc = subprocess.run([*mpirun_cmd(ranks), sys.executable] + (args or [str(script)]),
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HARD)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job hung for {HARD} s:\n{e.stdout}\n{e.stderr}")
    seconds = time.perf_counter() - start
    return proc.returncode, proc.stdout + proc.stderr, seconds


def ends(rc, out, seconds, *words):
    """The job failed, in time, and its output says each of `words`."""
    assert rc != 0, f"the job should fail:\n{out}"
    assert seconds < LIMIT, f"the job took {seconds:.1f} s to end:\n{out}"
    for w in words:
        assert w in out, f"{w!r} not in the output:\n{out}"


@pytest.mark.parametrize("leave", ["raise SystemExit(3)", "exit(3)", "sys.exit(0)", "pass"])
def test_one_rank_leaving_ends_the_job(tmp_path, leave):
    """rank 1 leaves (pass: its script simply ends) while the others all-reduce."""
    rc, out, seconds = run(tmp_path, f"""
        if rank == 1:
            {leave}
        else:
            ring_all_reduce(comm, np.ones(10))
    """, exit_timeout="1")
    how = {"exit(3)": "exit(3)", "sys.exit(0)": "sys.exit(0)"}.get(leave, "returned or raised SystemExit")
    ends(rc, out, seconds, "[rank 1] this rank is ending", how, "rank(s) 0, 2, 3 did not end")
    assert out.count("this rank is ending") == 1, out


def test_ctrl_c_on_one_rank_ends_the_job_at_once(tmp_path):
    """SIGINT on rank 1 while the others all-reduce: an interrupt, aborted at once (not an
    exit that waits out MINIDIST_EXIT_TIMEOUT, set long here so that waiting would show)."""
    rc, out, seconds = run(tmp_path, """
        import os, signal, time
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        else:
            ring_all_reduce(comm, np.ones(10))
    """, exit_timeout="60")
    ends(rc, out, seconds, "[rank 1] interrupted (KeyboardInterrupt)", "aborting all 4 ranks")
    assert "this rank is ending" not in out, out


def test_an_agreed_error_on_one_rank_only_ends_the_job(tmp_path):
    """GridError claims every rank raised it; here only rank 0 did, the others Split."""
    rc, out, seconds = run(tmp_path, """
        ProcessGrid(tp=3 if rank == 0 else 1)
    """)
    ends(rc, out, seconds, "[rank 0] this rank raised an error meant to be raised by every rank",
         "GridError: tp=3", "but rank(s) 1, 2, 3 did not raise it")


def test_an_agreed_error_on_some_ranks_that_all_end_is_printed_once(tmp_path):
    """Rank 2 alone raises; the others end too: nobody waits, and rank 2's message shows."""
    rc, out, seconds = run(tmp_path, """
        if rank == 2:
            ProcessGrid(tp=3)
    """)
    ends(rc, out, seconds, "[rank 2] minidist.comm.grid.GridError: tp=3", "raised on rank(s) 2 of 4")
    assert out.count("GridError:") == 1 and "abort" not in out.lower(), out


def test_different_algorithms_are_a_mismatch_on_every_rank(tmp_path):
    rc, out, seconds = run(tmp_path, """
        from minidist.comm import MismatchError
        try:
            all_reduce(comm, np.ones(5), impl="ring" if rank == 0 else "naive")
        except MismatchError as e:
            print(f"rank {rank} caught: {e}", flush=True)
            raise
    """)
    ends(rc, out, seconds, "rank 0 called ring_all_reduce", "called naive_all_reduce")
    assert out.count("caught: ranks called different collectives") == 4, out
    assert out.count("MismatchError:") == 1 and "abort" not in out.lower(), out


def test_an_endless_loop_on_one_rank_is_found_by_the_watchdog(tmp_path):
    """The others wait in the ring; their watchdog fires after 3 s and shows rank 1's loop."""
    rc, out, seconds = run(tmp_path, """
        if rank == 1:
            while True:
                x = sum(range(100))          # the endless loop
        ring_all_reduce(comm, np.ones(10))
    """, timeout="3")
    ends(rc, out, seconds, "minidist watchdog", "in ring_all_reduce", "MINIDIST_TIMEOUT=3",
         "[rank 1] minidist watchdog", "[rank 1] not inside minidist communication")
    # rank 1's stack shows the loop: the line it was on when asked, its test or its body
    assert "[rank 1]     while True:" in out or "[rank 1]     x = sum(range(100))" in out, out


def test_a_deadlock_shows_where_every_rank_waits(tmp_path):
    """Ranks 0 and 1 both receive first: a deadlock the watchdog ends with both stacks."""
    rc, out, seconds = run(tmp_path, """
        from minidist.comm import recv, send
        if rank < 2:
            got = recv(comm, 1 - rank, tag=5)
            send(comm, got, 1 - rank, tag=5)
    """, ranks=2, timeout="3")
    ends(rc, out, seconds, "[rank 0] thread MainThread: waiting", "recv from rank 1, tag 5",
         "[rank 1] thread MainThread: waiting", "recv from rank 0, tag 5", "got = recv(comm")


def test_ranks_that_end_a_little_apart_exit_cleanly(tmp_path):
    """Rank 0 ends 1.5 s after the others (a long report): within the wait, exit 0."""
    rc, out, seconds = run(tmp_path, """
        import time
        ring_all_reduce(comm, np.ones(10))
        if rank == 0:
            time.sleep(1.5)
            print("report done")
    """)
    assert rc == 0 and "report done" in out and "abort" not in out.lower(), out


def test_a_watchdog_that_never_fires_costs_nothing(tmp_path):
    """A second of sleep inside no collective is not a wait: no report, exit 0."""
    rc, out, _ = run(tmp_path, """
        import time
        ring_all_reduce(comm, np.ones(10))
        time.sleep(4)                      # longer than MINIDIST_TIMEOUT, outside comm
        ring_all_reduce(comm, np.ones(10))
    """, timeout="2")
    assert rc == 0 and "watchdog" not in out, out


# ----------------------------------------------------------------------------- the MPI test harness

def run_pytest(tmp_path, test_text, ranks=3, **env):
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(textwrap.dedent(test_text))
    return run(tmp_path, "", ranks=ranks, args=["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                "--only-mpi", "test_case.py"], **env)


def test_a_collection_error_on_one_rank_ends_the_run_at_once(tmp_path):
    rc, out, seconds = run_pytest(tmp_path, """
        import pytest
        from mpi4py import MPI
        pytestmark = pytest.mark.mpi
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise ImportError("rank 1 cannot import this module")

        def test_needs_everyone(comm):
            comm.Barrier()
    """)
    ends(rc, out, seconds, "[rank 1]", "rank 1 cannot import this module", "collection failed on rank(s) 1")
    assert out.count("ImportError: rank 1 cannot import this module") == 1, out


def test_the_harness_deadlock_report_reaches_the_log(tmp_path):
    """A test that deadlocks in raw MPI: the per-test watchdog's stacks are in the log."""
    rc, out, seconds = run_pytest(tmp_path, """
        import numpy as np
        import pytest
        pytestmark = pytest.mark.mpi

        def test_waits_forever(comm):
            buf = np.empty(1)
            comm.Recv(buf, (comm.Get_rank() + 1) % comm.Get_size(), 7)   # nobody sends
    """, ranks=2, MINIDIST_TEST_TIMEOUT=3)
    ends(rc, out, seconds, "test_waits_forever", "comm.Recv(buf", "MINIDIST_TEST_TIMEOUT")
