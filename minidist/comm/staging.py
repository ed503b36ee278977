"""Device arrays in the collectives: staged through host buffers, or handed to MPI as they are.

    x = backend.to_device(...)             # a CuPy array (MINIDIST_DEVICE=cuda) or the strict
    total = ring_all_reduce(comm, x)       # double's; the result is a device array too

Every public function of minidist.comm takes host (NumPy) or device arrays and returns the
kind it was given. MPI moves bytes it can address; a device array reaches it one of two ways:

  staged (the default; always under MINIDIST_DEVICE=strict)
      the array is copied to a host buffer (backend.to_numpy: device to host, counted), the
      collective runs on the host exactly as it does for a NumPy array, and the result is
      copied back (backend.to_device: host to device, counted). An all-reduce of M bytes
      costs 2 M over the host-device link (PCIe on most machines) besides its messages.
  direct (MINIDIST_DEVICE=cuda and an MPI library built with CUDA support)
      MPI reads and writes device memory itself ("CUDA-aware MPI": Open MPI, MPICH and
      MVAPICH can be built so; with GPUDirect RDMA the network card reads the GPU's memory
      without the host's help). The collective runs on device arrays, its additions
      are the device's, and no copy to the host is made. `wire` (checks.py) waits for the
      device's queued work before each buffer goes to MPI (MPI does not wait for it) and
      counts the buffer's bytes under transfers' "mpi_device".

The collectives are written once for both kinds: the array functions they call come from
`namespace(x)`, NumPy for a host array and the device's module for a device array (CuPy's
own idiom for code that runs on either: cupy.get_array_module). On the staged path every
array they see is a host array, so they run NumPy alone, as on the CPU.

Whether MPI supports CUDA is asked once: MPIX_Query_cuda_support (an Open MPI and MPICH
extension), which mpi4py exposes as MPI.Query_cuda_support where it wraps it (the 4.1
installed here does not: staged is then the path). MINIDIST_CUDA_AWARE_MPI=1 says yes for
an MPI that supports it but cannot be asked, =0 forces staging. On the CPU nothing is
staged: `staged` returns the function itself.

Both paths are this project's own design. The direct path has never run on a GPU here: it
is kept small, and tests/test_strict_comm.py runs it under the double with a stand-in for a
CUDA-aware MPI (a communicator that reads the double's memory), 1 and 3 ranks.
"""
import functools
import inspect
import os
import sys

import numpy as np
from mpi4py import MPI

from minidist import backend, transfers

ENV = "MINIDIST_CUDA_AWARE_MPI"


def cuda_aware_mpi(said=None):
    """True when the MPI library can read and write device memory (see above); `said`:
    MINIDIST_CUDA_AWARE_MPI's value, "" when unset."""
    if said:
        return said == "1"
    query = getattr(MPI, "Query_cuda_support", None)     # mpi4py versions that wrap it
    return bool(query()) if query is not None else False


_SAID = os.environ.get(ENV, "")
if _SAID not in ("", "0", "1"):      # every rank reads the same value: rank 0 says it, all stop
    from minidist.failfast import agreed_exit
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"error: {ENV} must be 0 or 1, not {_SAID!r}", file=sys.stderr, flush=True)
    agreed_exit(2)
# the path device arrays take, decided once per process
DIRECT = backend.DEVICE == "cuda" and cuda_aware_mpi(_SAID)


def on_device(x):
    """x is a device array, or a list of arrays one of which is."""
    if isinstance(x, (list, tuple)):
        return any(backend.on_device(a) for a in x)
    return backend.on_device(x)


def namespace(x):
    """The array module whose functions x's buffers are made with: NumPy for a host array,
    CuPy (or the strict double) for a device array."""
    return backend.xp if backend.on_device(x) else np


def asarray(x):
    """x itself when it is a device array (direct path), else np.asarray(x)."""
    return x if backend.on_device(x) else np.asarray(x)


def contiguous(x):
    """x as a C-contiguous array of its own kind (a copy only when it is not contiguous)."""
    return namespace(x).asarray(asarray(x), order="C")


# ----------------------------------------------------------------------------- the staged path

def to_host(x):
    """A device array (or list of arrays) as host arrays: device to host, counted."""
    if isinstance(x, (list, tuple)):
        return [backend.to_numpy(a) for a in x]
    return backend.to_numpy(x)


def to_device(result):
    """A collective's host result back on the device, counted: an array, a list of arrays,
    or None (a rank that gets nothing)."""
    if result is None:
        return None
    if isinstance(result, list):
        return [backend.to_device(a) for a in result]
    return backend.to_device(result)


def arrive(x):
    """(x as the collective runs on it, a function that gives its result back in x's kind).

    A device array on the staged path comes home now and its result goes back; anything
    else (a host array, a device array on the direct path) passes as it is."""
    if DIRECT or not on_device(x):
        return x, _as_is
    return to_host(x), to_device


def _as_is(result):
    return result


def staged(collective):
    """Decorate a collective `f(comm, x, ...)`: a device x (or a list of arrays with one on
    the device) is staged through the host, the result returned on the device.

    Collectives built from others (the naive all-reduce from reduce and broadcast) stage
    once, at the outermost call: the inner ones are handed host arrays."""
    if backend.DEVICE == "cpu":
        return collective                  # nothing can be on a device: the function itself
    name = list(inspect.signature(collective).parameters)[1]     # the array after comm

    @functools.wraps(collective)
    def either_kind(comm, *args, **kwargs):
        given = args[0] if args else kwargs.get(name)
        x, back = arrive(given)
        if x is given:
            return collective(comm, *args, **kwargs)
        if args:
            args = (x,) + args[1:]
        else:
            kwargs[name] = x
        return back(collective(comm, *args, **kwargs))
    return either_kind


# ----------------------------------------------------------------------------- the direct path

def hand_to_mpi(buf):
    """buf, about to be given to MPI. On the direct path a device buffer waits for the
    device's queued work first (the kernel that fills it may still run: MPI would read it
    half-written) and its bytes are counted; anything else passes as it is."""
    if DIRECT and backend.on_device(buf):
        backend.synchronize()
        transfers.count("mpi_device", buf.nbytes)
    return buf
