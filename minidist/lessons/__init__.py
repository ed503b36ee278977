"""Runnable lessons: `python -m minidist.lessons.NN_name` (under mpirun for the parallel ones)."""
