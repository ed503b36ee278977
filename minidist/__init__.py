"""minidist: distributed LLM training from scratch, one lesson per strategy.

Importing the package installs the fail-fast hooks (minidist/failfast.py): under
mpirun, an uncaught exception on any rank ends the whole job with its traceback shown,
and every exit is agreed with a bounded wait (MINIDIST_EXIT_TIMEOUT, default 10 s), instead
of leaving the other ranks waiting forever. It imports nothing heavy, not even mpi4py.
Importing minidist.comm also starts the watchdog (MINIDIST_TIMEOUT, default 300 s).

More ranks than cores (8 on a 2-core laptop): a waiting MPICH rank busy-polls, but it
yields the CPU every 1000 polls, so 8 ranks do not crawl here (the MPI test suite: 4
ranks 7-8 s, 8 ranks 17-22 s). MPIR_CVAR_ENABLE_HEAVY_YIELD=1 makes waiting ranks
sleep instead: a rank computing while 7 others wait ran 1.8x faster, but every message
paid about 1 ms more (a tiny all-reduce on 4 ranks 0.2 ms -> 1.6 ms) and the test suite
got slower, so it is left off; set it for compute-heavy runs such as long pipelines.
"""
from minidist import failfast as _failfast

_failfast.install()
