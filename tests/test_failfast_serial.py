"""Fail-fast, proven from outside: jobs that fail on one rank must end, quickly and loudly.

These tests launch mpirun in a subprocess (so they run in the serial suite, never under
mpirun themselves) and check the job ends within 20 seconds with a non-zero code and
the failure shown. Without the hooks each of them hangs until killed.
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
LIMIT = 20



def run_job(args, ranks, cwd, limit=60):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MINIDIST_EXIT_TIMEOUT="3", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([*mpirun_cmd(ranks), sys.executable] + args, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=limit)
    return proc, time.perf_counter() - start


@needs_mpirun
def test_exception_on_one_rank_ends_the_job(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import minidist
        from mpi4py import MPI
        from minidist.comm import ring_all_reduce
        comm = MPI.COMM_WORLD
        if comm.Get_rank() == 2:
            raise RuntimeError("rank 2 broke on purpose")
        ring_all_reduce(comm, np.ones(10))      # the others wait here for rank 2
    """))
    proc, seconds = run_job([str(script)], 4, tmp_path)
    assert proc.returncode != 0, "the job should fail"
    assert seconds < LIMIT, f"the job took {seconds:.1f} s to end"
    assert proc.stderr.count("RuntimeError: rank 2 broke on purpose") == 1, proc.stderr
    assert "[rank 2]" in proc.stderr


@needs_mpirun
def test_sys_exit_on_one_rank_ends_the_job(tmp_path):
    """sys.exit(3) on one rank: it would wait in MPI_Finalize, the others wait for it.
    (tests/test_no_hang.py covers every other way of leaving.)"""
    script = tmp_path / "early_exit.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import minidist
        from mpi4py import MPI
        from minidist.comm import ring_all_reduce
        comm = MPI.COMM_WORLD
        if comm.Get_rank() == 1:
            sys.exit(3)
        ring_all_reduce(comm, np.ones(10))
    """))
    proc, seconds = run_job([str(script)], 4, tmp_path)
    assert proc.returncode != 0 and seconds < LIMIT, (proc.returncode, seconds)
    assert "[rank 1] this rank is ending (sys.exit(3))" in proc.stderr, proc.stderr


@needs_mpirun
def test_agreed_exit_on_every_rank_is_quiet(tmp_path):
    script = tmp_path / "agreed_exit.py"
    script.write_text("import minidist\nfrom mpi4py import MPI\nfrom minidist.failfast import agreed_exit\n"
                      "MPI.COMM_WORLD.Barrier()\nagreed_exit(2)\n")
    proc, seconds = run_job([str(script)], 3, tmp_path)
    assert proc.returncode == 2 and "abort" not in proc.stderr.lower(), proc.stderr


@needs_mpirun
def test_exception_in_a_thread_ends_the_job(tmp_path):
    script = tmp_path / "thread_crash.py"
    script.write_text(textwrap.dedent("""
        import threading
        import numpy as np
        import minidist
        from mpi4py import MPI
        from minidist.comm import ring_all_reduce
        comm = MPI.COMM_WORLD
        def work():
            raise ValueError("a communication thread broke")
        if comm.Get_rank() == 1:
            t = threading.Thread(target=work)
            t.start()
            t.join()
            import time; time.sleep(60)         # the main thread would carry on for long
        ring_all_reduce(comm, np.ones(10))
    """))
    proc, seconds = run_job([str(script)], 3, tmp_path)
    assert proc.returncode != 0 and seconds < LIMIT, (proc.returncode, seconds)
    assert "a communication thread broke" in proc.stderr, proc.stderr


@needs_mpirun
def test_failing_assertion_in_mpi_pytest_ends_the_run(tmp_path):
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_broken.py").write_text(textwrap.dedent("""
        import numpy as np
        import pytest
        from minidist.comm import ring_all_reduce
        pytestmark = pytest.mark.mpi

        def test_one_rank_fails(comm):
            assert comm.Get_rank() != 1, "rank 1 fails on purpose"

        def test_next_needs_everyone(comm):
            assert ring_all_reduce(comm, np.ones(4))[0] == comm.Get_size()
    """))
    proc, seconds = run_job(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--only-mpi",
                             "test_broken.py"], 3, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert seconds < LIMIT, f"the run took {seconds:.1f} s to end"
    assert "rank 1 fails on purpose" in out and "[rank 1] FAILED" in out, (proc.returncode, seconds, out)


@needs_mpirun
def test_only_rank_0_prints_the_summary(tmp_path):
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_fine.py").write_text(
        "import pytest\n\n@pytest.mark.mpi\ndef test_fine(comm):\n    assert comm.Get_size() == 3\n")
    proc, _ = run_job(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--only-mpi", "test_fine.py"],
                      3, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summaries = [line for line in proc.stdout.splitlines() if " passed" in line]
    assert len(summaries) == 1, f"expected one summary line, got {summaries}"


@needs_mpirun
def test_agreed_error_prints_once_and_exits_nonzero(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import minidist
        from mpi4py import MPI
        from minidist.comm import ring_all_reduce
        comm = MPI.COMM_WORLD
        ring_all_reduce(comm, np.ones(3 + comm.Get_rank()))   # lengths differ: every rank raises
    """))
    proc, seconds = run_job([str(script)], 3, tmp_path)
    assert proc.returncode != 0 and seconds < LIMIT
    assert proc.stderr.count("MismatchError:") == 1, proc.stderr


def test_one_process_just_prints(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import minidist\nraise KeyError('plain')"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.count("KeyError: 'plain'") == 1, proc.stderr


def test_import_is_cheap():
    proc = subprocess.run([sys.executable, "-c", "import sys, minidist; print('mpi4py.MPI' in sys.modules)"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout.strip() == "False", "import minidist must not import mpi4py"
