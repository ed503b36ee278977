"""The comm layer on a device, with messages: staged through the host, or direct.

    MINIDIST_DEVICE=strict mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_strict_comm.py

(tests/test_strict_comm.py starts it so in the CPU suite; without a device, here it skips.)
Every collective is called on a device array and on the same host array: the device
result must hold the host result's very bits, and the message counters must not move.
Staged, each rank copies exactly its input home and its result back; direct (a CUDA-aware
MPI, simulated by a communicator that reads the double's memory), nothing is copied and MPI
touches exactly the bytes minidist.comm.stats counts as sent and received.
"""
import os

import numpy as np
import pytest

if os.environ.get("MINIDIST_DEVICE", "cpu").lower() == "cpu":
    pytest.skip("needs MINIDIST_DEVICE=strict (tests/test_strict_comm.py runs it so)",
                allow_module_level=True)

from minidist import backend, strict, transfers  # noqa: E402
from minidist.backend import on_device, to_device, to_numpy  # noqa: E402
import minidist.comm as c  # noqa: E402
from minidist.comm import staging, stats  # noqa: E402
from minidist.comm.nonblocking import ring_all_gather_start, ring_reduce_scatter_start  # noqa: E402

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "tiny arrays; more ranks repeat the same steps"


def calls(comm):
    """name -> (what this rank passes, from its (7, 5) float64 array; the call), pieces of
    every size."""
    n, r = comm.Get_size(), comm.Get_rank()
    lengths = [(7 * (i + 1)) // n - (7 * i) // n for i in range(n)]    # not array_split's cut
    mine = c.chunk_bounds(35, n)[r:r + 2]
    whole = lambda x: x                                   # noqa: E731
    return {
        "ring_all_reduce": (whole, lambda x: c.ring_all_reduce(comm, x, op="avg")),
        "naive_all_reduce": (whole, lambda x: c.naive_all_reduce(comm, x)),
        "recursive_doubling": (whole, lambda x: c.recursive_doubling_all_reduce(comm, x)),
        "rabenseifner": (whole, lambda x: c.rabenseifner_all_reduce(comm, x, op="max")),
        "ring_reduce_scatter": (whole, lambda x: c.ring_reduce_scatter(comm, x, axis=1)),
        "ring_reduce_scatter_v": (whole, lambda x: c.ring_reduce_scatter_v(comm, x, lengths)),
        "ring_all_gather": (lambda x: x[:r + 1], lambda x: c.ring_all_gather(comm, x, axis=0)),
        "broadcast": (whole, lambda x: c.broadcast(comm, x, root=n - 1)),
        "reduce": (whole, lambda x: c.reduce(comm, x, op="avg", root=1 % n)),
        "all_to_all": (whole, lambda x: c.all_to_all(comm, x)),
        "all_to_all_v": (lambda x: [x[:j] for j in range(n)], lambda x: c.all_to_all_v(comm, x)),
        "ring_all_reduce_start": (whole, lambda x: c.ring_all_reduce_start(comm, x).wait()),
        "ring_reduce_scatter_start": (whole, lambda x: ring_reduce_scatter_start(comm, x).wait()),
        "ring_all_gather_start": (lambda x: x.reshape(-1)[mine[0]:mine[1]],
                                  lambda x: ring_all_gather_start(comm, x, 35).wait()),
    }


NAMES = ("ring_all_reduce", "naive_all_reduce", "recursive_doubling", "rabenseifner",
         "ring_reduce_scatter", "ring_reduce_scatter_v", "ring_all_gather", "broadcast", "reduce",
         "all_to_all", "all_to_all_v", "ring_all_reduce_start", "ring_reduce_scatter_start",
         "ring_all_gather_start")


def _arrays(result):
    return result if isinstance(result, list) else [result]


def _nbytes(result):
    return sum(a.nbytes for a in _arrays(result) if a is not None)


def _run_both(comm, name):
    """(bytes passed, host result, device call's counters, transfers during the device call)."""
    host = np.random.default_rng(comm.Get_rank()).standard_normal((7, 5))
    pick, call = calls(comm)[name]
    with stats.measure() as on_host:
        want = call(pick(host))
    x = pick(to_device(host))
    comm.Barrier()
    before = transfers.snapshot()
    with stats.measure() as on_dev:
        got = call(x)
    after = transfers.snapshot()
    for g, w in zip(_arrays(got), _arrays(want), strict=True):
        assert (g is None) == (w is None), f"{name}: a result on one side only"
        if w is not None:
            assert isinstance(w, np.ndarray) and on_device(g), f"{name}: host in host out, device in device out"
            assert np.array_equal(to_numpy(g), w), f"{name}: the device result differs from the host's"
    assert dict(on_dev) == dict(on_host), f"{name}: the message counters moved with the device"
    return _nbytes(pick(host)), want, on_dev, {k: after[k] - before[k] for k in after}


@pytest.mark.skipif(staging.DIRECT, reason="the staged path (this MPI reads device memory)")
@pytest.mark.parametrize("name", NAMES)
def test_staged(comm, name):
    given, want, _, moved = _run_both(comm, name)
    assert moved == {"d2h": given, "h2d": _nbytes(want), "mpi_device": 0}, \
        f"{name} on rank {comm.Get_rank()}: staged {moved}; in {given} B, out {_nbytes(want)} B"


@pytest.mark.skipif(backend.DEVICE != "strict", reason="simulates a CUDA-aware MPI on the double")
@pytest.mark.parametrize("name", NAMES)
def test_direct(comm, name, monkeypatch):
    monkeypatch.setattr(staging, "DIRECT", True)
    _, _, counted, moved = _run_both(strict.CudaAwareComm(comm), name)
    data = sum(row["bytes_sent"] + row["bytes_recv"] for k, row in counted.items() if k != "check")
    assert moved == {"d2h": 0, "h2d": 0, "mpi_device": data}, \
        f"{name} on rank {comm.Get_rank()}: direct {moved}; MPI moved {data} B of device memory"


@pytest.mark.skipif(staging.DIRECT, reason="the staged path (this MPI reads device memory)")
def test_send_and_recv(comm):
    """send stages its device array home; recv(device=True) copies what came to the device."""
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    host = np.arange(12.0).reshape(3, 4)
    x = to_device(host)
    before = transfers.snapshot()
    if comm.Get_rank() == 0:
        c.send(comm, x, 1, tag=5)
        c.send(comm, host, 1, tag=6)
    elif comm.Get_rank() == 1:
        got, plain = c.recv(comm, 0, tag=5, device=True), c.recv(comm, 0, tag=6)
    moved = {k: v - before[k] for k, v in transfers.snapshot().items()}
    if comm.Get_rank() == 0:
        assert moved == {"d2h": host.nbytes, "h2d": 0, "mpi_device": 0}, moved
    elif comm.Get_rank() == 1:
        assert moved == {"d2h": 0, "h2d": host.nbytes, "mpi_device": 0}, moved
        assert on_device(got) and isinstance(plain, np.ndarray)
        assert np.array_equal(to_numpy(got), host) and np.array_equal(plain, host)
