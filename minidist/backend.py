"""The array library, chosen once: NumPy by default, CuPy when MINIDIST_DEVICE=cuda.

Engine and model code write `from minidist.backend import xp` and call `xp.matmul`,
`xp.exp`, ... so the switch to a GPU stays in this one file. Collectives move host
(NumPy) arrays; `to_numpy` brings a device array home.
"""
import os

import numpy

DEVICE = os.environ.get("MINIDIST_DEVICE", "cpu").lower()

if DEVICE == "cuda":
    try:
        import cupy as xp  # noqa: F401
    except ImportError as e:  # a clear message beats an ImportError deep in a lesson
        raise SystemExit(f"MINIDIST_DEVICE=cuda needs CuPy: pip install -e '.[gpu]' ({e})")
elif DEVICE == "cpu":
    xp = numpy
else:
    raise SystemExit(f"MINIDIST_DEVICE must be 'cpu' or 'cuda', not {DEVICE!r}")

DTYPES = {"float32": numpy.float32, "float64": numpy.float64}


def dtype_of(name):
    """'float32' / 'float64' (or a NumPy dtype) -> a NumPy scalar type."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {name!r}")
        return DTYPES[name]
    return numpy.dtype(name).type


def to_numpy(a):
    """A host NumPy array for `a` (a no-op on the CPU)."""
    if xp is numpy:
        return numpy.asarray(a)
    return xp.asnumpy(a)


def synchronize():
    """Wait for queued device work, so a timer measures it (a no-op on the CPU)."""
    if xp is not numpy:
        xp.cuda.Device().synchronize()
