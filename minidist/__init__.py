"""minidist: distributed LLM training from scratch, one lesson per strategy.

Importing the package installs the fail-fast hooks (minidist/failfast.py): under
mpirun, an uncaught exception on any rank ends the whole job with its traceback shown,
instead of leaving the other ranks waiting forever. It imports nothing heavy.
"""
from minidist import failfast as _failfast

_failfast.install()
