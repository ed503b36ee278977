"""The comm layer on a device: device arrays in, device arrays out, every crossing counted.

    MINIDIST_DEVICE=strict python -m pytest -q tests/test_strict_comm.py

Under MINIDIST_DEVICE=strict (the CPU double of a GPU, minidist/strict.py) each public
collective is called with a device array on one rank (COMM_SELF): it must return a device
array holding the host call's very bits, count exactly its input's bytes device-to-host and
its result's bytes host-to-device (minidist/comm/staging.py: the staged path), and leave
minidist.comm.stats' message bytes as a host call does. A comm function that hands a device
array to MPI itself fails under the double; the direct path (a CUDA-aware MPI, simulated by a
communicator that reads the double's memory) copies nothing to the host.

In the CPU suite this file starts itself again under MINIDIST_DEVICE=strict (one test, one
subprocess), and tests/mpi/test_strict_comm.py on 3 ranks, where messages are the point.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("MINIDIST_DEVICE", "cpu").lower()


def _run(cmd):
    env = dict(os.environ, MINIDIST_DEVICE="strict", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd[-4:])} under MINIDIST_DEVICE=strict:\n" \
        + done.stdout[-4000:] + done.stderr[-2000:]


if DEVICE == "cpu":
    def test_the_comm_layer_under_the_strict_device():
        _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))])

    def test_the_comm_layer_under_the_strict_device_on_three_ranks():
        import launcher
        if not launcher.HAVE:
            pytest.skip(launcher.NO_LAUNCHER)
        _run(launcher.mpirun_cmd(3) + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--only-mpi",
                                       str(ROOT / "tests/mpi/test_strict_comm.py")])

else:
    from mpi4py import MPI

    import minidist.comm as c
    from minidist import backend, strict, transfers
    from minidist.backend import on_device, to_device, to_numpy
    from minidist.comm import staging, stats
    from minidist.comm.nonblocking import ring_all_gather_start, ring_reduce_scatter_start

    SELF = MPI.COMM_SELF
    HOST = np.arange(24, dtype=np.float64).reshape(4, 6) / 7      # M = 192 bytes
    M = HOST.nbytes

    # name -> the call on this rank's array (at one rank every result holds M bytes)
    CALLS = {
        "ring_all_reduce": lambda x: c.ring_all_reduce(SELF, x, op="avg"),
        "naive_all_reduce": lambda x: c.naive_all_reduce(SELF, x),
        "recursive_doubling": lambda x: c.recursive_doubling_all_reduce(SELF, x),
        "rabenseifner": lambda x: c.rabenseifner_all_reduce(SELF, x, op="max"),
        "mpi_all_reduce": lambda x: c.mpi_all_reduce(SELF, x),
        "all_reduce_auto": lambda x: c.all_reduce(SELF, x, algorithm="auto", check=False),
        "ring_reduce_scatter": lambda x: c.ring_reduce_scatter(SELF, x, axis=1),
        "ring_reduce_scatter_v": lambda x: c.ring_reduce_scatter_v(SELF, x, [4]),
        "ring_all_gather": lambda x: c.ring_all_gather(SELF, x, axis=-1),
        "broadcast": lambda x: c.broadcast(SELF, x),
        "reduce": lambda x: c.reduce(SELF, x, op="avg"),
        "all_to_all": lambda x: c.all_to_all(SELF, x),
        "all_to_all_v": lambda x: c.all_to_all_v(SELF, [x]),
        "ring_all_reduce_start": lambda x: c.ring_all_reduce_start(SELF, x).wait(),
        "ring_reduce_scatter_start": lambda x: ring_reduce_scatter_start(SELF, x).wait(),
        "ring_all_gather_start": lambda x: ring_all_gather_start(SELF, x.reshape(-1), 24).wait(),
    }

    def _arrays(result):
        return result if isinstance(result, list) else [result]

    @pytest.mark.skipif(staging.DIRECT, reason="the staged path (this MPI reads device memory)")
    @pytest.mark.parametrize("name", sorted(CALLS))
    def test_staged_device_in_device_out_counted(name):
        call = CALLS[name]
        call(HOST)              # once before: "auto" agrees the model's constants on a first call
        with stats.measure() as on_host:
            want = call(HOST)
        x = to_device(HOST)
        before = transfers.snapshot()
        with stats.measure() as on_dev:
            got = call(x)
        after = transfers.snapshot()
        for g, w in zip(_arrays(got), _arrays(want), strict=True):
            assert isinstance(w, np.ndarray) and on_device(g), f"{name}: host in host out, device in device out"
            assert np.array_equal(to_numpy(g), w), f"{name}: the device result differs from the host's"
        moved = {k: after[k] - before[k] for k in after}
        assert moved == {"d2h": M, "h2d": M, "mpi_device": 0}, f"{name}: staged {moved}, expected M = {M} each way"
        assert dict(on_dev) == dict(on_host), f"{name}: the message counters moved with the staging"

    def test_a_result_split_from_a_device_array_comes_back_at_its_size():
        """Reduce-scatter's result is a piece: the copy back is the piece's bytes, not M."""
        x = to_device(HOST)
        before = transfers.snapshot()
        got = c.ring_reduce_scatter(SELF, x[:2])                # a view, 96 bytes in and out
        after = transfers.snapshot()
        assert on_device(got) and got.shape == (2, 6)
        assert (after["d2h"] - before["d2h"], after["h2d"] - before["h2d"]) == (M // 2, M // 2)

    def test_a_host_array_moves_nothing():
        before = transfers.snapshot()
        got = c.ring_all_reduce(SELF, HOST)
        assert isinstance(got, np.ndarray) and transfers.snapshot() == before

    @pytest.mark.skipif(DEVICE != "strict", reason="the double refuses; real CuPy would hand MPI a pointer")
    def test_handing_a_device_array_to_mpi_is_refused():
        """A planted comm function that skips the staging: MPI is given the device array."""
        x = to_device(HOST)

        def planted_all_reduce(comm, x):
            out = backend.xp.empty_like(x)
            comm.Allreduce(x, out)
            return out
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
            planted_all_reduce(SELF, x)
        # the package's own collective, with its staging taken off, fails the same way
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
            c.mpi_all_reduce.__wrapped__(SELF, x)

    @pytest.mark.skipif(DEVICE != "strict", reason="simulates a CUDA-aware MPI on the double")
    def test_the_direct_path_copies_nothing_to_the_host(monkeypatch):
        monkeypatch.setattr(staging, "DIRECT", True)
        comm, x = strict.CudaAwareComm(SELF), to_device(HOST)
        before = transfers.snapshot()
        got = c.mpi_all_reduce(comm, x)                     # MPI reads x's copy, writes out
        ring = c.ring_all_reduce(comm, x)                   # one rank: no message at all
        after = transfers.snapshot()
        assert on_device(got) and on_device(ring)
        assert np.array_equal(to_numpy(got), HOST) and np.array_equal(to_numpy(ring), HOST)
        moved = {k: after[k] - before[k] for k in after}
        assert moved == {"d2h": 0, "h2d": 0, "mpi_device": 2 * M}, moved
