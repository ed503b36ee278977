"""The strict device double (minidist/strict.py): what it refuses, what it counts, and that
its arithmetic is NumPy's. Imported directly, so it runs whatever MINIDIST_DEVICE says."""
import copy
import re

import numpy as np
import pytest

from minidist import strict as xp
from minidist import transfers

IMPLICIT = re.escape("Implicit conversion to a NumPy array is not allowed. "
                     "Please use `.get()` to construct a NumPy array explicitly")
HOST = re.escape("Unsupported type <class 'numpy.ndarray'>")
SCALAR = "only size-1 arrays can be converted to Python scalars"


@pytest.fixture(autouse=True)
def _counters():
    transfers.reset()
    yield
    transfers.reset()


def dev(values):
    return xp.asarray(np.asarray(values, dtype=np.float64))


# ----------------------------------------------------------------------------- refusals

IMPLICIT_CASES = {
    "np.asarray": lambda a: np.asarray(a),
    "np.array": lambda a: np.array(a),
    "np.exp (a ufunc)": lambda a: np.exp(a),
    "np.sum (a function)": lambda a: np.sum(a),
    "np.concatenate": lambda a: np.concatenate([a, a]),
    "np.float64(a)": lambda a: np.float64(a),
    "host[device mask]": lambda a: np.ones(3)[a > 0],
    "bytes": lambda a: bytes(a),
    "np.from_dlpack": lambda a: np.from_dlpack(a),
}


@pytest.mark.parametrize("name", sorted(IMPLICIT_CASES))
def test_implicit_device_to_host_is_refused(name):
    with pytest.raises(TypeError, match=IMPLICIT):
        IMPLICIT_CASES[name](dev([1.0, 2.0, 3.0]))


def test_memoryview_is_refused():
    with pytest.raises(TypeError):
        memoryview(dev([1.0]))


def test_mpi_buffer_is_refused():
    MPI = pytest.importorskip("mpi4py.MPI")
    a, comm = dev([1.0, 2.0]), MPI.COMM_SELF
    with pytest.raises(TypeError, match=IMPLICIT):
        comm.Isend(a, dest=0, tag=7)
    with pytest.raises(TypeError, match=IMPLICIT):
        comm.Send([a, MPI.DOUBLE], dest=0, tag=7)
    with pytest.raises(TypeError, match=IMPLICIT):
        comm.Allreduce(MPI.IN_PLACE, a)
    out = np.zeros(2)
    comm.Allreduce(np.ones(2), out)                 # host buffers still work
    assert out.tolist() == [1.0, 1.0]


HOST_CASES = {
    "a + host": lambda a, h: a + h,
    "host + a": lambda a, h: h + a,
    "host * a": lambda a, h: h * a,
    "host @ a": lambda a, h: h @ a,
    "a < host": lambda a, h: a < h,
    "xp.add(a, host)": lambda a, h: xp.add(a, h),
    "xp.add(a, 1, out=host)": lambda a, h: xp.add(a, 1, out=h),
    "np.add(a, 1, out=host)": lambda a, h: np.add(a, 1, out=h),
    "xp.concatenate([a, host])": lambda a, h: xp.concatenate([a, h]),
    "xp.where(a > 0, a, host)": lambda a, h: xp.where(a > 0, a, h),
    "a[host_index]": lambda a, h: a[h.astype(np.int64)],
    "a[(0, host)]": lambda a, h: a.reshape(1, 3)[0, h.astype(np.int64)],
    "a.clip(host)": lambda a, h: a.clip(h),
    "xp.add.at(a, 0, host)": lambda a, h: xp.add.at(a, 0, h[0:1]),
    "xp.exp(host)": lambda a, h: xp.exp(h),
}


@pytest.mark.parametrize("name", sorted(HOST_CASES))
def test_host_array_in_a_device_operation_is_refused(name):
    with pytest.raises(TypeError, match=HOST):
        HOST_CASES[name](dev([1.0, 2.0, 3.0]), np.ones(3))


def test_host_array_refused_in_place_and_in_setitem():
    a, h = dev([1.0, 2.0, 3.0]), np.ones(3)
    for fn in (lambda: a.__iadd__(h), lambda: a.__setitem__(slice(None), h),
               lambda: a.__setitem__(Ellipsis, h)):
        with pytest.raises(TypeError, match=HOST):
            fn()
    with pytest.raises(TypeError, match=HOST):
        h += a
    assert a.get().tolist() == [1.0, 2.0, 3.0]      # nothing was written


def test_ufunc_keywords_are_checked_too():
    a, mask = dev([1.0, 2.0, 3.0]), xp.asarray(np.array([True, False, True]))
    xp.add(a, 1.0, out=a, where=mask)
    assert a.get().tolist() == [2.0, 2.0, 4.0]
    with pytest.raises(TypeError, match=HOST):
        xp.add(a, 1.0, out=a, where=np.ones(3, bool))


def test_ufunc_at_only_where_cupy_has_it():
    a = dev([1.0, 2.0])
    xp.maximum.at(a, xp.asarray(np.array([1])), 5.0)
    with pytest.raises(NotImplementedError, match="ufunc.at covers only"):
        xp.multiply.at(a, xp.asarray(np.array([0])), 2.0)
    assert a.get().tolist() == [1.0, 5.0]


def test_ufuncs_refuse_lists_as_cupy_does():
    with pytest.raises(TypeError, match=re.escape("Unsupported type <class 'list'>")):
        xp.add([1.0, 2.0], dev([1.0, 2.0]))


@pytest.mark.parametrize("convert", [float, int, complex, bool])
def test_scalar_conversion_of_many_elements_is_refused(convert):
    with pytest.raises(TypeError, match=SCALAR):
        convert(dev([1.0, 2.0]))
    assert transfers.snapshot()["d2h"] == 0


def test_a_device_number_is_no_python_index_nor_a_shape():
    n = xp.asarray(np.int64(2))
    a = xp.arange(6)
    for fn in (lambda: range(5)[n], lambda: a[:n], lambda: xp.zeros(n), lambda: xp.zeros((n, 2)),
               lambda: xp.split(a, [n]), lambda: a.reshape(n, 3), lambda: xp.arange(n),
               lambda: xp.broadcast_to(a, (n, 6)), lambda: xp.repeat(a, n)):
        with pytest.raises(TypeError, match="the explicit, counted copy"):
            fn()
    assert float(a[n]) == 2.0                            # an index array on the device: fine
    assert xp.split(a, [int(n)])[1].shape == (4,)        # int(n): the explicit way
    assert transfers.snapshot()["d2h"] == 16


def test_truth_of_many_elements_is_also_a_value_error_as_in_numpy():
    with pytest.raises(ValueError):
        bool(dev([1.0, 2.0]))


def test_dtypes_cupy_lacks_are_refused():
    """ml_dtypes' bfloat16 is refused by the same check; it is slow to import, so the test uses
    dtypes NumPy has built in: long double, datetime, raw bytes (bfloat16's kind), strings."""
    a = dev([1.0, 2.0]).astype(np.float32)
    for fn in (lambda: xp.asarray(np.ones(2, np.longdouble)), lambda: a.astype(np.longdouble),
               lambda: xp.zeros(2, dtype="datetime64[s]"), lambda: a.view("V4"),
               lambda: xp.asarray(np.array(["x"])), lambda: xp.ndarray((2,), "V2")):
        with pytest.raises(ValueError, match="Unsupported dtype"):
            fn()
    assert a.view(np.uint32).dtype == np.uint32           # the way bf16 rounds on a device
    assert a.astype(np.float16).dtype == np.float16       # CuPy has float16


def test_file_io_names_are_refused():
    for name in ("save", "load", "fromfile", "frombuffer"):
        with pytest.raises(AttributeError, match="host work"):
            getattr(xp, name)


def test_pickle_is_refused():
    import pickle
    with pytest.raises(TypeError, match=IMPLICIT):
        pickle.dumps(dev([1.0]))

# ----------------------------------------------------------------------------- transfers counted


def test_each_transfer_is_counted_with_its_bytes():
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = xp.asarray(host)                                  # 24 bytes in
    assert transfers.snapshot() == {"h2d": 24, "d2h": 0, "mpi_device": 0}
    host[0, 0] = 99.0                                     # a copy: the device is apart
    xp.array([1, 2, 3], dtype=np.int64)                   # 24 more
    xp.ascontiguousarray(host.T)                          # 24 more
    xp.asarray(2.0)                                       # 8 more
    assert transfers.snapshot()["h2d"] == 80
    back = xp.asnumpy(a)                                  # 24 out
    assert isinstance(back, np.ndarray) and back[0, 0] == 0.0
    a.get()                                               # 24
    a.tolist()                                            # 24
    float(a[1, 2])                                        # 4
    a[0, 1].item()                                        # 4
    int(a[1, 1])                                          # 4
    bool(a[1, 1])                                         # 4
    f"{a.sum():.1f}"                                      # 4
    a.tobytes()                                           # 24
    assert transfers.snapshot() == {"h2d": 80, "d2h": 116, "mpi_device": 0}


def test_work_on_the_device_moves_nothing():
    a = xp.zeros((4, 4), xp.float64) + xp.ones(4)
    b = (a @ a.T).sum(axis=0)
    xp.asarray(b)                                         # a device array: as it is
    assert xp.asarray(b) is b
    assert xp.array(b) is not b                           # a copy, on the device
    xp.add.at(a, xp.asarray(np.array([0, 0])) * 0, 1.0)  # 16 bytes for the index only
    assert transfers.snapshot() == {"h2d": 16, "d2h": 0, "mpi_device": 0}


def test_backend_on_strict_counts_each_crossing(monkeypatch):
    from minidist import backend
    monkeypatch.setattr(backend, "xp", xp)
    monkeypatch.setattr(backend, "DEVICE", "strict")
    d = backend.to_device(np.arange(4, dtype=np.float32))            # 16 bytes in
    assert backend.on_device(d) and not backend.on_device(np.ones(2))
    assert backend.to_device(d) is d                                  # already there: free
    assert backend.to_device(d, dtype=np.float64).dtype == np.float64  # cast on the device
    h = backend.to_numpy(d)                                           # 16 bytes out
    assert type(h) is np.ndarray and h.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert backend.to_numpy(h).tolist() == h.tolist()                 # host: no transfer
    backend.synchronize()
    assert transfers.snapshot() == {"h2d": 16, "d2h": 16, "mpi_device": 0}


def test_backend_cpu_path_counts_nothing(monkeypatch):
    from minidist import backend
    monkeypatch.setattr(backend, "xp", np)
    monkeypatch.setattr(backend, "DEVICE", "cpu")
    h = np.ones(3)
    assert backend.to_device(h) is h and backend.to_numpy(h) is h
    assert not backend.on_device(h) and not backend.on_device(dev([1.0]))
    transfers.reset()
    backend.to_numpy(backend.to_device([1.0, 2.0]))
    assert transfers.snapshot() == {"h2d": 0, "d2h": 0, "mpi_device": 0}


def test_a_bad_device_name_is_one_line_naming_the_three(monkeypatch):
    import importlib.util
    from minidist import backend
    monkeypatch.setenv("MINIDIST_DEVICE", "tpu")
    spec = importlib.util.spec_from_file_location("backend_again", backend.__file__)
    with pytest.raises(SystemExit) as stop:              # SystemExit(text): text on stderr, exit 1
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert stop.value.code == "MINIDIST_DEVICE must be one of cpu, cuda, strict, not 'tpu'"

# ----------------------------------------------------------------------------- NumPy's values

rng = np.random.default_rng(0)
X, Y = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
W = rng.standard_normal((4, 2))

OPS = {
    "x + y": lambda m, x, y, w: x + y,
    "x - 2.5": lambda m, x, y, w: x - 2.5,
    "2.5 / x": lambda m, x, y, w: 2.5 / x,
    "np.float64 * x": lambda m, x, y, w: np.float64(0.5) * x,
    "x ** 2": lambda m, x, y, w: x ** 2,
    "-abs(x)": lambda m, x, y, w: -abs(x),
    "x @ w": lambda m, x, y, w: x @ w,
    "x > y": lambda m, x, y, w: x > y,
    "x[1:, ::2]": lambda m, x, y, w: x[1:, ::2],
    "x[None, ..., 0]": lambda m, x, y, w: x[None, ..., 0],
    "x[x > 0]": lambda m, x, y, w: x[x > 0],
    "x.sum(axis=0)": lambda m, x, y, w: x.sum(axis=0),
    "x.mean(-1, keepdims)": lambda m, x, y, w: x.mean(axis=-1, keepdims=True),
    "x.max()": lambda m, x, y, w: x.max(),
    "x.argmax(1)": lambda m, x, y, w: x.argmax(axis=1),
    "x.var()": lambda m, x, y, w: x.var(),
    "x.T.reshape(2, 6)": lambda m, x, y, w: x.T.reshape(2, 6),
    "x.swapaxes.astype": lambda m, x, y, w: x.swapaxes(0, 1).astype(np.float32),
    "exp, tanh, log": lambda m, x, y, w: m.log(m.exp(m.tanh(x)) + 1.0),
    "where": lambda m, x, y, w: m.where(x > 0, x, y),
    "concatenate, split": lambda m, x, y, w: m.split(m.concatenate([x, y], axis=1), 4, axis=1)[2],
    "cumsum": lambda m, x, y, w: m.cumsum(x, axis=1),
    "take_along_axis": lambda m, x, y, w: m.take_along_axis(x, m.argsort(x, axis=1), axis=1),
    "einsum": lambda m, x, y, w: m.einsum("ij,ij->i", x, y),
    "linalg.norm": lambda m, x, y, w: m.linalg.norm(x),
    "maximum.reduce": lambda m, x, y, w: m.maximum.reduce(x, axis=0),
    "add.outer": lambda m, x, y, w: m.add.outer(x[0], y[0]),
    "logaddexp.accumulate": lambda m, x, y, w: m.logaddexp.accumulate(x, axis=1),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_values_are_numpys(name):
    want = OPS[name](np, X.copy(), Y.copy(), W.copy())
    got = OPS[name](xp, xp.asarray(X), xp.asarray(Y), xp.asarray(W))
    assert isinstance(got, xp.ndarray)                    # results stay on the device
    np.testing.assert_array_equal(xp.asnumpy(got), want)


def test_in_place_updates_and_scatter_add_are_numpys():
    want, got = X.copy(), xp.asarray(X)
    for op in ("__iadd__", "__imul__", "__isub__", "__itruediv__"):
        getattr(want, op)(Y)
        assert getattr(got, op)(xp.asarray(Y)) is got
    want[0, 1:3] = 7.0
    got[0, 1:3] = 7.0
    idx = np.array([0, 2, 0])
    np.add.at(want, idx, X[:3])
    xp.add.at(got, xp.asarray(idx), xp.asarray(X[:3]))
    np.testing.assert_array_equal(got.get(), want)
    out = xp.empty_like(got)
    assert xp.tanh(got, out=out) is out                   # out= gives back the same array
    np.testing.assert_array_equal(out.get(), np.tanh(want))


def test_views_iteration_and_copies():
    a = dev([[1.0, 2.0], [3.0, 4.0]])
    assert a.base is None and a[1:].base is a and a.reshape(4).base is a and a.T.base is a
    rows = list(a)
    assert all(isinstance(r, xp.ndarray) and r.shape == (2,) for r in rows)
    b, c = copy.copy(a), copy.deepcopy(a)
    b[0, 0] = 9.0
    assert float(a[0, 0]) == 1.0 and float(c[0, 0]) == 1.0
    assert a.astype(a.dtype, copy=False) is a
    assert "device='strict'" in repr(a) and transfers.snapshot()["d2h"] == 16


def test_namespace_passes_types_and_constants():
    assert xp.float32 is np.float32 and xp.inf == np.inf and xp.newaxis is None
    assert xp.dtype("float32").str == "<f4" and xp.finfo(xp.float32).eps == np.finfo(np.float32).eps
    assert xp.get_array_module(dev([1.0])) is xp and xp.get_array_module(np.ones(1)) is np
    xp.cuda.Device().synchronize()
    empty = xp.ndarray((2, 3), xp.float32)                # as cupy.ndarray(shape, dtype)
    assert isinstance(empty, xp.ndarray) and empty.shape == (2, 3) and empty.base is None
    r = xp.random.RandomState(3).standard_normal(4)
    assert isinstance(r, xp.ndarray)
    np.testing.assert_array_equal(r.get(), np.random.RandomState(3).standard_normal(4))
