"""Benchmarks: `python -m minidist.bench model` and `mpirun -n 4 python -m minidist.bench collectives`."""
