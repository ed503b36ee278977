"""What the MPI tests share: every rank's input, made on every rank, and comparisons.

Each rank can build every other rank's input from the seed, so the single-process
answer (np.sum over the ranks' inputs, ...) needs no communication at all.
"""
import numpy as np

FLOATS = (np.float32, np.float64)
DTYPES = (np.float32, np.float64, np.int32, np.int64)
# bounds on max|a-b| / max|b| when a sum runs in another order
TOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-14}


def inputs(size, shape, dtype, seed=0):
    """One array per rank: small integers for int dtypes (no overflow), normals for floats."""
    rng = np.random.default_rng([seed, size] + list(shape))
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-50, 50, size=shape).astype(dtype) for _ in range(size)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]


def reference(arrays, op):
    """The single-process answer of a reduction over ranks."""
    stack = np.stack(arrays)
    if op == "max":
        return stack.max(axis=0)
    total = stack.sum(axis=0, dtype=np.float64 if stack.dtype.kind == "f" else stack.dtype)
    return (total / len(arrays) if op == "avg" else total).astype(stack.dtype)


def assert_close(got, want, what):
    """Exact for integers, relative to max(max|want|, 1) for floats; plain-words failure."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if got.size == 0:
        return
    if want.dtype.kind != "f":
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        assert bad.size == 0, (f"{what}: element {bad[0]} is {got.reshape(-1)[bad[0]]}, "
                               f"expected {want.reshape(-1)[bad[0]]}")
        return
    # the inputs are of order 1, so a sum that cancels to near 0 still carries errors of
    # order 1e-7 (float32): measure against the larger of max|want| and 1
    scale = max(float(np.max(np.abs(want))), 1.0)
    rel = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    assert rel <= TOL[want.dtype], f"{what}: max relative difference {rel:.2e} > {TOL[want.dtype]:.0e}"


def assert_same_on_all_ranks(comm, y, what):
    """Every rank holds the same bits (data parallelism needs identical weights everywhere)."""
    y = np.ascontiguousarray(y)
    everyone = np.empty((comm.Get_size(),) + y.shape, y.dtype)
    comm.Allgather(y, everyone)
    for r in range(comm.Get_size()):
        assert np.array_equal(everyone[r].reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), \
            f"{what}: rank {r}'s result differs in its bits from rank {comm.Get_rank()}'s"
