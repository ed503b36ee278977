"""A strict device on the CPU: arrays that follow CuPy's rules, with NumPy underneath.

`MINIDIST_DEVICE=strict` makes this module the array namespace `xp` (minidist/backend.py).
Its arrays (`DeviceArray`, also `xp.ndarray`) hold a NumPy array, but behave as if it were
in GPU memory: code that would fail on CuPy fails here, on a machine without a GPU. SciPy
and scikit-learn test their array-API code the same way, on array-api-strict. About 700
lines but one idea: a wrapper that hands every operation to NumPy and checks what crosses
at each door (DeviceArray first, then ufuncs, then the namespace at the end).

What is refused, with a TypeError in CuPy's wording:
- a device array turning into a host array without asking: `np.asarray(a)`, `np.array(a)`,
  `memoryview(a)`, an MPI send of `a`, and (stricter than CuPy, on purpose) any NumPy
  function or ufunc called on `a` ("Implicit conversion to a NumPy array is not allowed");
  CuPy itself hands `np.exp(a)` / `np.sum(a)` to its own functions (__array_ufunc__,
  __array_function__), which hides code that says np where it means xp;
- a host `numpy.ndarray` given to a device operation: `a + host`, `xp.add(a, host)`,
  `xp.concatenate([a, host])`, and (stricter than CuPy, which copies these over quietly:
  cupy/_core/_routines_indexing.pyx) `a[host_index]`, `a[...] = host` ("Unsupported type
  <class 'numpy.ndarray'>"); a host array crosses with to_device first, counted. Python
  and NumPy scalars are fine, as on CuPy;
- `float(a)`, `int(a)`, `bool(a)` of more than one element;
- a device array where a Python integer is read on the host: an index or slice bound
  (`range(n)[a]`, `b[:a]`: CuPy has no __index__, cupy/cupy#5784), a shape, split points,
  repeats (`xp.zeros(a)`, `xp.split(b, [a])`: CuPy reads those on the host, cupy/cupy#5822);
- a dtype CuPy lacks (ml_dtypes' bfloat16, long double, strings, objects), as soon as an
  array would have it: CuPy's ValueError "Unsupported dtype ...".

What is allowed and counted (minidist/transfers.py): host -> device through `xp.asarray`,
`xp.array`, `xp.ascontiguousarray` of host data (and list indices); device -> host through
`xp.asnumpy`, `.get()`, `.item()`, `.tolist()`, `.tobytes()`, `float()` / `int()` /
`bool()` / `format()` of one element. Creating arrays on the device (`xp.zeros`,
`xp.arange`, ...) and computing on them moves nothing.

Not modelled: `xp.<name>` is NumPy's name, so a NumPy function that CuPy lacks is not
caught; a Python list given to a function other than asarray/array (CuPy copies it over)
is not counted; CuPy's random generators draw other numbers than NumPy's for one seed
(here xp.random is NumPy's).
"""
import operator
import sys
import types

import numpy as _np

from minidist import transfers

IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")
SCALAR = "only size-1 arrays can be converted to Python scalars"
IMPLICIT_INDEX = "int(x) is the explicit, counted copy; or keep the number on the host"
_SCALARS = (bool, int, float, complex, _np.generic)


def _unsupported(x):
    return TypeError(f"Unsupported type {type(x)}")


def _implicit(what):
    return TypeError(f"{IMPLICIT}\n  ({what} was given a device array: use xp, or bring it home "
                     f"with minidist.backend.to_numpy)")


class AmbiguousTruth(TypeError, ValueError):
    """bool() of an array of several elements: NumPy and CuPy raise ValueError; the
    device rules call it a refused conversion (TypeError). Either except clause catches it."""

# ----------------------------------------------------------------------------- wrapping

_alloc = object.__new__
# the dtypes CuPy has: bool, signed and unsigned ints, float16/32/64, complex64/128
_TYPE_CHARS = frozenset("?bhilqBHILQefdFD")


def _unsupported_dtype(dtype):
    return ValueError(f"Unsupported dtype {dtype}\n  (CuPy has no such dtype: on a device, "
                      f"bfloat16 rounding is done in float32 arithmetic)")


def _wrap(a, parent=None):
    """A DeviceArray for a NumPy result: arrays wrap, NumPy scalars become 0-d arrays (CuPy
    returns 0-d arrays where NumPy returns scalars), anything else passes."""
    if isinstance(a, _np.ndarray):
        return _new(a, () if parent is None else (parent,))
    if isinstance(a, _np.generic):
        return _new(_np.asarray(a))
    return a


def _new(a, parents=()):
    """Wrap the NumPy array a. A view's .base is the wrapper of the array that owns the
    memory, as on CuPy: the parent it was made from (or that parent's base) when it is one."""
    if a.dtype.char not in _TYPE_CHARS:
        raise _unsupported_dtype(a.dtype)
    d = _alloc(DeviceArray)
    d._a, d._base = a, None
    root = a.base
    if not isinstance(root, _np.ndarray):
        return d
    while isinstance(root.base, _np.ndarray):
        root = root.base
    for p in parents:
        owner = p if p._base is None else p._base
        if owner._a is root:
            d._base = owner
            return d
    d._base = _new(root)
    return d


def _operand(x):
    """x as NumPy may see it inside a device operation (None: not ours to handle)."""
    if isinstance(x, DeviceArray):
        return x._a
    if isinstance(x, _SCALARS):
        return x
    if isinstance(x, (_np.ndarray, list, tuple)):
        raise _unsupported(x)
    return None


def _unwrap(x, seen):
    """Arguments of a wrapped NumPy function: DeviceArrays unwrapped (noted in seen, id ->
    wrapper, so a result that is an input comes back as the same wrapper), lists and
    tuples searched, host arrays refused."""
    t = type(x)
    if t is DeviceArray:
        seen[id(x._a)] = x
        return x._a
    if t in _PLAIN:
        return x
    if t is tuple or t is list:
        for v in x:
            if type(v) not in _PLAIN:
                return t([_unwrap(v, seen) for v in x])
        return x                                 # a shape, axes: nothing to look at
    if isinstance(x, _np.ndarray):
        raise _unsupported(x)
    return x


_PLAIN = frozenset((int, float, bool, complex, str, type(None), slice, type(Ellipsis), type))


def _plain(args):
    """No array anywhere in args (ints, shapes, axes, None): nothing to unwrap or check."""
    for a in args:
        t = type(a)
        if t not in _PLAIN:
            if t is not tuple:
                return False
            for v in a:
                if type(v) not in _PLAIN:
                    return False
    return True


def _rewrap(r, seen):
    if isinstance(r, _np.ndarray):
        known = seen.get(id(r))
        return _new(r, seen.values()) if known is None else known
    if isinstance(r, _np.generic):
        return _new(_np.asarray(r))
    if isinstance(r, (tuple, list)):
        items = [_rewrap(v, seen) for v in r]
        return type(r)(*items) if hasattr(r, "_fields") else type(r)(items)
    if isinstance(r, (_np.random.RandomState, _np.random.Generator)):
        return _Object(r)
    return r


# Parameters CuPy reads on the host (shapes, split points, counts): a device array there is
# refused by CuPy (cupy/cupy#5822: cupy.zeros of a device shape), so it is here too.
# name -> ((position, keyword), ...)
HOST_PARAMS = {
    "zeros": ((0, "shape"),), "ones": ((0, "shape"),), "empty": ((0, "shape"),),
    "full": ((0, "shape"),), "arange": ((0, "start"), (1, "stop"), (2, "step")),
    "linspace": ((2, "num"),), "eye": ((0, "N"), (1, "M"), (2, "k")), "identity": ((0, "n"),),
    "tri": ((0, "N"), (1, "M"), (2, "k")), "triu": ((1, "k"),), "tril": ((1, "k"),),
    "reshape": ((1, "shape"), (1, "newshape")), "broadcast_to": ((1, "shape"),),
    "split": ((1, "indices_or_sections"),), "array_split": ((1, "indices_or_sections"),),
    "expand_dims": ((1, "axis"),), "pad": ((1, "pad_width"),), "tile": ((1, "reps"),),
    "repeat": ((1, "repeats"),), "roll": ((1, "shift"),),
    "moveaxis": ((1, "source"), (2, "destination")), "swapaxes": ((1, "axis1"), (2, "axis2")),
    "transpose": ((1, "axes"),),
}
# the same for methods: positions count from the first argument after self (None: all)
HOST_METHOD_PARAMS = {"reshape": None, "transpose": None, "swapaxes": None,
                      "repeat": ((0, "repeats"),)}


def _holds_device_array(x):
    t = type(x)
    if t is DeviceArray:
        return True
    if t is tuple or t is list:
        for v in x:
            if type(v) is DeviceArray or (type(v) in (tuple, list) and _holds_device_array(v)):
                return True
    return False


def _check_host_params(name, params, args, kwargs):
    """Refuse a device array among the host parameters (params None: every argument)."""
    if params is None:
        bad = [None for v in args if _holds_device_array(v)]
        bad += [k for k, v in kwargs.items() if _holds_device_array(v)]
    else:
        bad = [key for pos, key in params if (pos < len(args) and _holds_device_array(args[pos]))
               or (key in kwargs and _holds_device_array(kwargs[key]))]
    if bad:
        raise TypeError(f"{name}(): {bad[0] or 'its arguments'} must be host numbers, not device "
                        f"arrays:\n  CuPy reads them on the host; {IMPLICIT_INDEX}")


def _function(f, name):
    host = HOST_PARAMS.get(name.rsplit(".", 1)[-1])

    def wrapped(*args, **kwargs):
        if host is not None:
            _check_host_params(name, host, args, kwargs)
        seen = {}
        args = [_unwrap(a, seen) for a in args]
        if kwargs:
            kwargs = {k: _unwrap(v, seen) for k, v in kwargs.items()}
        return _rewrap(f(*args, **kwargs), seen)
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__doc__ = f"NumPy's {name} on device arrays (minidist.strict)."
    return wrapped

# ----------------------------------------------------------------------------- the array


def _binary(op, reflected=False):
    def method(self, other):
        o = other._a if type(other) is DeviceArray else _operand(other)
        if o is None:
            return NotImplemented
        r = op(o, self._a) if reflected else op(self._a, o)
        if type(r) is _np.ndarray and r.base is None:       # the usual case, made short
            d = _alloc(DeviceArray)
            d._a, d._base = r, None
            return d
        return _wrap(r)
    return method


def _inplace(op):
    def method(self, other):
        o = other._a if type(other) is DeviceArray else _operand(other)
        if o is None:
            return NotImplemented
        op(self._a, o)
        return self
    return method


def _unary(op):
    return lambda self: _wrap(op(self._a))


def _method(name):
    checked = name in HOST_METHOD_PARAMS
    host = HOST_METHOD_PARAMS.get(name)

    def method(self, *args, **kwargs):
        if not kwargs and _plain(args):          # a.reshape(2, 3), a.sum(0): the usual case
            r = getattr(self._a, name)(*args)
            if type(r) is _np.ndarray:
                return self if r is self._a else _new(r, (self,))
            return _rewrap(r, {})
        if checked:
            _check_host_params(name, host, args, kwargs)
        seen = {id(self._a): self}
        if args:
            args = [_unwrap(a, seen) for a in args]
        if kwargs:
            kwargs = {k: _unwrap(v, seen) for k, v in kwargs.items()}
        return _rewrap(getattr(self._a, name)(*args, **kwargs), seen)
    method.__name__ = name
    return method


def _index(i):
    if isinstance(i, tuple):
        return tuple(_index(j) for j in i)
    if isinstance(i, DeviceArray):
        return i._a
    if isinstance(i, _np.ndarray):
        raise _unsupported(i)
    if isinstance(i, list):                      # CuPy copies a list index to the device
        host = _np.asarray([_index(j) for j in i])
        transfers.count("h2d", host.nbytes)
        return host
    return i


def _one(a, what):
    """The single element of a, counted as a device -> host copy."""
    if a._a.size != 1:
        raise TypeError(f"{SCALAR} (asked for {what} of shape {a._a.shape})")
    transfers.count("d2h", a._a.itemsize)
    return a._a.reshape(()).item()


class DeviceArray:
    """An array in (pretend) device memory: see the module's docstring for its rules."""
    __slots__ = ("_a", "_base", "__weakref__")
    __hash__ = None
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, order="C"):
        """xp.ndarray(shape, dtype): an uninitialised device array, as cupy.ndarray(...)."""
        a = _np.empty(shape, dtype, order=order)
        if a.dtype.char not in _TYPE_CHARS:
            raise _unsupported_dtype(a.dtype)
        self._a, self._base = a, None

    # -- NumPy may not look inside
    def __array__(self, dtype=None, copy=None):
        raise _implicit("NumPy")

    def __array_function__(self, func, types, args, kwargs):
        raise _implicit(f"numpy.{func.__name__}")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc.__name__ in _COMPARISONS:     # as CuPy: a 0-d host array is a scalar here
            inputs = tuple(x[()] if isinstance(x, _np.ndarray) and x.ndim == 0 else x for x in inputs)
        for x in inputs + tuple(kwargs.get("out", ())):
            if isinstance(x, _np.ndarray):
                raise _unsupported(x)
        # a NumPy scalar on the left of an operator (np.float64(2) * a) lands here
        if method == "__call__" and not kwargs and len(inputs) == 2 and ufunc.__name__ in _OPERATOR_UFUNCS:
            return _UFunc(ufunc)(*inputs)
        raise _implicit(f"numpy.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}"))

    def __dlpack__(self, *args, **kwargs):       # mpi4py and np.from_dlpack look here
        raise _implicit("MPI (or DLPack)")

    def __dlpack_device__(self):
        raise _implicit("MPI (or DLPack)")

    def __bytes__(self):
        raise TypeError(IMPLICIT)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{IMPLICIT}\n  (pickle was given a device array)")

    # -- facts (no transfer)
    shape = property(lambda self: self._a.shape, lambda self, s: setattr(self._a, "shape", s))
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    base = property(lambda self: self._base)
    T = property(lambda self: _wrap(self._a.T, self))
    real = property(lambda self: _wrap(self._a.real, self))
    imag = property(lambda self: _wrap(self._a.imag, self))

    def __repr__(self):
        return f"DeviceArray(shape={self._a.shape}, dtype={self._a.dtype}, device='strict')"

    __str__ = __repr__

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        for i in range(len(self._a)):
            yield _wrap(self._a[i], self)

    # -- explicit transfers (counted)
    def get(self, stream=None, order="C", out=None):
        transfers.count("d2h", self._a.nbytes)
        if out is not None:
            out[...] = self._a
            return out
        return _np.array(self._a, order=order, copy=True)

    def item(self):
        if self._a.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        transfers.count("d2h", self._a.itemsize)
        return self._a.item()

    def tobytes(self, order="C"):
        transfers.count("d2h", self._a.nbytes)
        return self._a.tobytes(order)

    def tolist(self):
        transfers.count("d2h", self._a.nbytes)
        return self._a.tolist()

    def __float__(self):
        return float(_one(self, "float()"))

    def __int__(self):
        return int(_one(self, "int()"))

    def __complex__(self):
        return complex(_one(self, "complex()"))

    def __index__(self):                         # CuPy has none on purpose (cupy/cupy#5784)
        raise TypeError(f"a device array cannot be a Python index, slice bound or size:\n"
                        f"  (a hidden copy to the host); {IMPLICIT_INDEX}")

    def __bool__(self):
        if self._a.size != 1:
            raise AmbiguousTruth(f"{SCALAR}:\n  the truth value of shape {self._a.shape} "
                                 f"is ambiguous (use .any() or .all())")
        return bool(_one(self, "bool()"))

    def __format__(self, spec):
        if not spec:
            return repr(self)
        return format(_one(self, f"format(..., {spec!r})"), spec)

    def __divmod__(self, other):
        return self // other, self % other

    def __rdivmod__(self, other):
        return other // self, other % self

    # -- copies on the device
    def __copy__(self):
        return _new(self._a.copy())

    def __deepcopy__(self, memo):
        return _new(self._a.copy())

    # -- indexing
    def __getitem__(self, index):
        return _wrap(self._a[_index(index)], self)

    def __setitem__(self, index, value):
        v = _operand(value)
        if v is None:
            raise _unsupported(value)
        self._a[_index(index)] = v


_OPERATORS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "matmul": operator.matmul, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift}
_INPLACE = {
    "add": operator.iadd, "sub": operator.isub, "mul": operator.imul, "truediv": operator.itruediv,
    "floordiv": operator.ifloordiv, "mod": operator.imod, "pow": operator.ipow,
    "matmul": operator.imatmul, "and": operator.iand, "or": operator.ior, "xor": operator.ixor,
    "lshift": operator.ilshift, "rshift": operator.irshift}
for _name, _op in _OPERATORS.items():
    setattr(DeviceArray, f"__{_name}__", _binary(_op))
    setattr(DeviceArray, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(DeviceArray, f"__i{_name}__", _inplace(_INPLACE[_name]))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(DeviceArray, f"__{_name}__", _binary(getattr(operator, _name)))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(DeviceArray, f"__{_name}__", _unary(getattr(operator, _name)))
DeviceArray.__hash__ = None

METHODS = ("reshape", "transpose", "swapaxes", "astype", "copy", "ravel", "flatten", "sum",
           "mean", "max", "min", "argmax", "argmin", "prod", "std", "var", "cumsum", "cumprod",
           "all", "any", "fill", "clip", "view", "squeeze", "dot", "round", "nonzero",
           "repeat", "take", "put", "sort", "argsort", "conj", "diagonal", "trace",
           "searchsorted", "partition", "argpartition")
for _name in METHODS:
    setattr(DeviceArray, _name, _method(_name))

_COMPARISONS = {"less", "less_equal", "equal", "not_equal", "greater", "greater_equal"}
# the ufuncs NumPy calls for an operator with a NumPy scalar on the left
_OPERATOR_UFUNCS = {
    "add", "subtract", "multiply", "true_divide", "divide", "floor_divide", "remainder",
    "power", "matmul", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift",
    "right_shift", "less", "less_equal", "equal", "not_equal", "greater", "greater_equal"}

# ----------------------------------------------------------------------------- ufuncs


def _ufunc_args(args, seen):
    """Ufuncs take device arrays and scalars only (CuPy's ufuncs refuse lists too)."""
    out = []
    for a in args:
        if isinstance(a, DeviceArray):
            seen[id(a._a)] = a
            out.append(a._a)
        elif isinstance(a, _SCALARS):
            out.append(a)
        else:
            raise _unsupported(a)
    return out


def _ufunc_kwargs(kwargs, seen):
    """out= (one array or a tuple), where=, initial=: device arrays unwrapped, host refused."""
    if not kwargs:
        return kwargs
    done = {}
    for k, v in kwargs.items():
        if isinstance(v, tuple) and k == "out":
            done[k] = tuple(None if o is None else _ufunc_args([o], seen)[0] for o in v)
        elif isinstance(v, (DeviceArray, _np.ndarray)):
            done[k] = _ufunc_args([v], seen)[0]
        else:
            done[k] = v
    return done


class _UFunc:
    """A NumPy ufunc on device arrays: call, .at, .reduce, .accumulate, .outer, .reduceat."""
    __slots__ = ("_u",)

    def __init__(self, ufunc):
        self._u = ufunc

    def __getattr__(self, name):                 # nin, nout, identity, __name__, ...
        return getattr(self._u, name)

    def __repr__(self):
        return f"<strict ufunc {self._u.__name__!r}>"

    def _run(self, fn, args, kwargs):
        seen = {}
        args = _ufunc_args(args, seen)
        return _rewrap(fn(*args, **_ufunc_kwargs(kwargs, seen)), seen)

    def __call__(self, *args, **kwargs):
        return self._run(self._u, args, kwargs)

    def reduce(self, a, *args, **kwargs):
        return self._run(self._u.reduce, (a,), dict(kwargs, **_positional(args, "axis", "dtype", "out")))

    def accumulate(self, a, *args, **kwargs):
        return self._run(self._u.accumulate, (a,), dict(kwargs, **_positional(args, "axis", "dtype", "out")))

    def outer(self, a, b, **kwargs):
        return self._run(self._u.outer, (a, b), kwargs)

    def reduceat(self, a, indices, *args, **kwargs):
        if not isinstance(indices, DeviceArray):
            raise _unsupported(indices)
        return self._run(lambda x, **k: self._u.reduceat(x, indices._a, *args, **k), (a,), kwargs)

    def at(self, a, indices, b=None):
        if self._u.__name__ not in _SCATTER:
            raise NotImplementedError(f"{self._u.__name__}.at: CuPy's ufunc.at covers only\n  "
                                      f"{', '.join(sorted(_SCATTER))}")
        if not isinstance(a, DeviceArray):
            raise _unsupported(a)
        if b is None:
            self._u.at(a._a, _index(indices))
        else:
            self._u.at(a._a, _index(indices), _ufunc_args([b], {})[0])


# the ufuncs whose .at CuPy implements (as a scatter: cupy/_core/_kernel.pyx, ufunc.at)
_SCATTER = frozenset(("add", "subtract", "maximum", "minimum", "bitwise_and", "bitwise_or",
                      "bitwise_xor"))


def _positional(args, *names):
    return dict(zip(names, args))

# ----------------------------------------------------------------------------- objects, submodules


class _Object:
    """A NumPy object whose methods make arrays (a RandomState, a Generator): they make
    device arrays here."""
    __slots__ = ("_o",)

    def __init__(self, obj):
        self._o = obj

    def __getattr__(self, name):
        attr = getattr(self._o, name)
        return _function(attr, name) if callable(attr) else attr

    def __repr__(self):
        return f"<strict {type(self._o).__name__}>"


def _maker(cls):
    def make(*args, **kwargs):
        seen = {}
        return _Object(cls(*[_unwrap(a, seen) for a in args],
                           **{k: _unwrap(v, seen) for k, v in kwargs.items()}))
    make.__name__ = cls.__name__
    return make


class _Namespace:
    """A NumPy submodule (random, linalg, fft) on device arrays."""

    def __init__(self, module, name):
        self._module, self.__name__ = module, name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _translate(getattr(self._module, name), f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


_SUBMODULES = ("random", "linalg", "fft")

# names refused: file and buffer I/O is host work (CuPy's save/load/fromfile copy quietly;
# here the copy is asked for with to_numpy), and the rest have no CuPy counterpart
REFUSED = frozenset((
    "save", "savez", "savez_compressed", "load", "loadtxt", "savetxt", "genfromtxt", "fromfile",
    "frombuffer", "fromstring", "fromregex", "fromiter", "memmap", "ctypeslib", "lib", "ma",
    "rec", "char", "testing", "matrix", "asmatrix", "nditer", "ndenumerate", "vectorize",
    "frompyfunc"))


def _translate(value, name):
    if isinstance(value, _np.ufunc):
        return _UFunc(value)
    if isinstance(value, type):
        if issubclass(value, (_np.random.RandomState, _np.random.Generator)):
            return _maker(value)
        return value                             # dtypes, finfo, iinfo, errstate, ...
    if isinstance(value, types.ModuleType):
        short = name.rsplit(".", 1)[-1]
        if short in _SUBMODULES:
            return _Namespace(value, name)
        raise AttributeError(f"minidist.strict has no submodule {name!r}")
    if callable(value):
        return _function(value, name)
    return value                                 # pi, inf, newaxis, ...

# ----------------------------------------------------------------------------- the namespace

ndarray = DeviceArray


def _host_to_device(obj, dtype=None, order=None, ndmin=0):
    """A new device array from host data, counted as h2d (a list that holds device arrays
    is stacked on the device: nothing crosses)."""
    if _holds_device_array(obj):
        seen = {}
        return _new(_np.array(_unwrap_nested(obj, seen), dtype=dtype, order=order or "K", ndmin=ndmin))
    host = _np.array(obj, dtype=dtype, order=order or "K", copy=True, ndmin=ndmin)
    transfers.count("h2d", host.nbytes)
    return _new(host)


def _unwrap_nested(obj, seen):
    if isinstance(obj, (list, tuple)):
        return [_unwrap_nested(v, seen) for v in obj]
    return _unwrap(obj, seen)


def asarray(a, dtype=None, order=None, *, copy=None):
    """A device array for a: a device array comes back as it is (cast on the device if a
    dtype is asked); host data is copied over (counted h2d)."""
    if isinstance(a, DeviceArray):
        out = _np.asarray(a._a, dtype=dtype, order=order, copy=copy)
        return a if out is a._a else _new(out, (a,))
    if copy is False:
        raise ValueError("xp.asarray(host data, copy=False): the data must be copied to the device")
    return _host_to_device(a, dtype, order)


asanyarray = asarray


def array(obj, dtype=None, copy=True, order="K", ndmin=0):
    """A new device array: a copy on the device of a device array, a counted h2d copy of
    host data."""
    if isinstance(obj, DeviceArray):
        out = _np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin)
        return obj if out is obj._a else _new(out)
    return _host_to_device(obj, dtype, order, ndmin)


def ascontiguousarray(a, dtype=None):
    if isinstance(a, DeviceArray):
        out = _np.ascontiguousarray(a._a, dtype=dtype)
        return a if out is a._a else _new(out)
    return _host_to_device(_np.ascontiguousarray(a, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None):
    """A host NumPy copy of a device array (counted d2h); host data passes through."""
    if isinstance(a, DeviceArray):
        return a.get(stream, order, out)
    if out is not None:
        out[...] = a
        return out
    return _np.asarray(a, order=order)


def get_array_module(*args):
    """This module if any argument is a device array, else numpy (as cupy.get_array_module)."""
    for a in args:
        if isinstance(a, DeviceArray):
            return sys.modules[__name__]
    return _np


class _Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def synchronize(self):
        """Nothing is queued on this device: every op ran when it was called."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class cuda:  # noqa: N801  (spelled as cupy.cuda)
    """The part of cupy.cuda that minidist calls."""
    Device = _Device

    @staticmethod
    def is_available():
        return False


class CudaAwareComm:
    """A stand-in for a CUDA-aware MPI, for tests of the direct path only: `comm`'s methods
    called with the double's device buffers read and write their memory, as such an MPI reads a
    GPU's. Anyone else handing a DeviceArray to MPI is refused."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        method = getattr(self._comm, name)
        if not callable(method):
            return method
        mem = lambda v: v._a if isinstance(v, DeviceArray) else v   # noqa: E731
        return lambda *a, **k: method(*map(mem, a), **{n: mem(v) for n, v in k.items()})


def __getattr__(name):
    """Every other NumPy name, on device arrays (cached after the first look-up)."""
    if name in REFUSED:
        raise AttributeError(f"minidist.strict has no {name!r}: file and buffer I/O is host work; "
                             f"bring arrays home with minidist.backend.to_numpy and use numpy")
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        value = getattr(_np, name)
    except AttributeError:
        raise AttributeError(f"module 'minidist.strict' has no attribute {name!r}") from None
    value = _translate(value, name)
    globals()[name] = value
    return value
