"""The array library, chosen once by MINIDIST_DEVICE: cpu (NumPy, the default), cuda (CuPy)
or strict (minidist.strict: a CPU test double of a device that keeps CuPy's rules).

Engine and model code write `from minidist.backend import xp` and call `xp.matmul`,
`xp.exp`, ... so the switch to a GPU stays in this one file. Data crosses between host
and device only through the explicit, counted doors below (minidist/transfers.py):

    to_device(a)   host -> device (h2d)        to_numpy(a)   device -> host (d2h)
    on_device(a)   is a a device array?        synchronize() wait for queued device work

Why strict: this project's machines have no GPU, so a CuPy path nobody has run would
fail in many places at once on its first GPU. SciPy and scikit-learn meet the same
problem for the array API by testing on array-api-strict, an implementation that refuses
what a GPU library refuses. minidist.strict does that for CuPy's rules: its arrays refuse
to become host arrays implicitly (np.asarray, any np. function, float() of many
elements, an MPI buffer) and refuse host arrays in device operations, with CuPy's
TypeError wording, while counting every explicit transfer. Code that runs under strict
has no hidden host/device mix on the lines it ran. On cpu nothing moves or is counted.
"""
import os

import numpy
# NumPy imports numpy.random on its first use, and the code Cython generates for its modules
# ends in a bare `except: pass`: a Ctrl-C that lands in that import is swallowed (seen here,
# the first time a model was built). Imported now, before any run has begun.
import numpy.random  # noqa: F401

from minidist import transfers

DEVICES = ("cpu", "cuda", "strict")
DEVICE = os.environ.get("MINIDIST_DEVICE", "cpu").lower()

if DEVICE == "cuda":
    try:
        import cupy as xp  # noqa: F401
    except ImportError as e:  # a clear message beats an ImportError deep in a lesson
        raise SystemExit(f"MINIDIST_DEVICE=cuda needs CuPy: pip install -e '.[gpu]' ({e})")
elif DEVICE == "strict":
    from minidist import strict as xp
elif DEVICE == "cpu":
    xp = numpy
else:
    raise SystemExit(f"MINIDIST_DEVICE must be one of {', '.join(DEVICES)}, not {DEVICE!r}")

DTYPES = {"float32": numpy.float32, "float64": numpy.float64}


def dtype_of(name):
    """'float32' / 'float64' (or a NumPy dtype) -> a NumPy scalar type."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {name!r}")
        return DTYPES[name]
    return numpy.dtype(name).type


def on_device(a):
    """True for a device array (a CuPy array, a strict DeviceArray); always False on cpu."""
    return xp is not numpy and isinstance(a, xp.ndarray)


def to_numpy(a):
    """A host NumPy array for `a`: a counted device -> host copy for a device array,
    numpy.asarray for host data (a no-op on the CPU)."""
    if not on_device(a):
        return numpy.asarray(a)
    if DEVICE == "cuda":                          # CuPy keeps no counter: count here
        transfers.count("d2h", a.nbytes)
    return xp.asnumpy(a)                          # strict counts its own copies


def to_device(a, dtype=None):
    """A device array for `a`: a counted host -> device copy for host data, `a` itself
    for a device array (cast on the device if dtype differs); numpy.asarray on the CPU."""
    if xp is numpy:
        return numpy.asarray(a, dtype=dtype)
    if DEVICE == "cuda" and not on_device(a):
        a = numpy.asarray(a, dtype=dtype)
        transfers.count("h2d", a.nbytes)
    return xp.asarray(a, dtype=dtype)


def synchronize():
    """Wait for queued device work, so a timer measures it (a no-op on the CPU)."""
    if xp is not numpy:
        xp.cuda.Device().synchronize()
