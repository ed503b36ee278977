"""Run a benchmark by name.

    python -m minidist.bench model                 # GPT training step, beside PyTorch when importable
    mpirun -n 4 python -m minidist.bench collectives  # nccl-tests style table, ring beside MPI's own
"""
import importlib
import sys

from minidist.failfast import agreed_exit

NAMES = ("model", "collectives")

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        print(f"usage: python -m minidist.bench {{{','.join(NAMES)}}} [flags]", file=sys.stderr)
        agreed_exit(2)
    name = sys.argv.pop(1)
    agreed_exit(importlib.import_module(f"minidist.bench.{name}").main())
