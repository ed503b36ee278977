"""Bytes that crossed between host and device, counted where they cross.

    h2d          host -> device copies (to_device, xp.asarray of host data, comm staging)
    d2h          device -> host copies (to_numpy, .get(), float() of a device scalar, ...)
    mpi_device   bytes MPI read or wrote straight from device memory (CUDA-aware MPI)

On the CPU nothing is a transfer and every counter stays 0. Under MINIDIST_DEVICE=strict
the device double (minidist/strict.py) counts every copy it makes; under
MINIDIST_DEVICE=cuda only the explicit crossings (minidist/backend.py, the comm layer)
are counted, since CuPy itself keeps no such counter.
"""
KINDS = ("h2d", "d2h", "mpi_device")

BYTES = {kind: 0 for kind in KINDS}


def count(kind, nbytes):
    """Add nbytes to the counter of kind ('h2d', 'd2h' or 'mpi_device')."""
    if kind not in BYTES:
        raise ValueError(f"transfer kind must be one of {', '.join(KINDS)}, not {kind!r}")
    BYTES[kind] += int(nbytes)


def snapshot():
    """A copy of the counters now (subtract two snapshots for the bytes in between)."""
    return dict(BYTES)


def reset():
    """Set every counter back to 0."""
    for kind in BYTES:
        BYTES[kind] = 0
