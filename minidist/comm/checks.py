"""Agreement before data: every rank learns every rank's shape, dtype, op and root.

A ring whose ranks disagree on the length sends chunks of different sizes and either
hangs or returns garbage. So before moving data each collective makes one small
all-gather of a fixed-size descriptor (16 int64: 128 bytes per rank) and compares; a
mismatch raises the same `MismatchError` on every rank, naming the ranks that differ.
This control message uses MPI's own Allgather and is counted under "check" in
minidist.comm.stats, apart from the data. Pass `check=False` to a collective to skip it
(the benchmark does, to time the algorithm alone).

Also here: the reduction ops (sum, avg, max) as in-place NumPy ufuncs, and `agree`.
"""
import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.failfast import AgreedError

DESC_LEN = 16        # [error, ndim, dtype char, itemsize, op, root, axis, 9 dims...]
MAX_DIMS = DESC_LEN - 7
OPS = ("sum", "avg", "max")


class MismatchError(AgreedError):
    """Ranks called a collective with inputs that cannot belong together (raised on all)."""


def reduce_ufunc(op):
    """The NumPy ufunc that combines two partial results: np.add for sum and avg."""
    return np.maximum if op == "max" else np.add


def finish_avg(y, size):
    """avg = sum / size, in place (float arrays only; checked before)."""
    np.divide(y, size, out=y, casting="unsafe")
    return y


# problems a rank can see in its own input; the code travels in the descriptor so every
# rank can name the problem of every other rank
PROBLEMS = ("", "the op must be one of sum, avg, max", "op 'avg' needs a float array",
            "arrays of Python objects cannot be sent",
            "a split along an axis needs an array of at least one dimension",
            "the axis is out of range", "the root is not a rank of this communicator")


def local_problem(x, op=None, axis=None, root=None, size=None):
    """The code (index into PROBLEMS) of a problem this rank sees alone, or 0."""
    if op is not None and op not in OPS:
        return 1
    if root is not None and not 0 <= root < size:
        return 6
    if x is None:
        return 0
    if op == "avg" and not np.issubdtype(x.dtype, np.floating):
        return 2
    if x.dtype.hasobject:
        return 3
    if axis is not None and x.ndim == 0:
        return 4
    if axis is not None and not -x.ndim <= axis < x.ndim:
        return 5
    return 0


def describe(x, op=None, root=None, axis=None, problem=0):
    """This rank's descriptor: 16 int64 that say what it passed to the collective."""
    d = np.full(DESC_LEN, -1, dtype=np.int64)
    d[0] = problem
    d[4] = OPS.index(op) if op in OPS else -1
    d[5] = -1 if root is None else root
    d[6] = -1 if axis is None else axis
    if x is not None:
        shape = list(x.shape)
        if len(shape) > MAX_DIMS:   # fold the trailing dims: enough to catch a mismatch
            shape = shape[:MAX_DIMS - 1] + [int(np.prod(shape[MAX_DIMS - 1:]))]
        d[1], d[2], d[3] = x.ndim, ord(x.dtype.char), x.dtype.itemsize
        d[7:7 + len(shape)] = shape
    return d


def shape_of(row):
    """The shape a descriptor row describes (None when that rank passed no array)."""
    if row[1] < 0:
        return None
    return tuple(int(v) for v in row[7:7 + min(int(row[1]), MAX_DIMS)])


def dtype_of(row):
    return None if row[1] < 0 else np.dtype(chr(int(row[2])))


def _text(row):
    """'shape (4,) float32, op sum, axis 0': what a descriptor row says, in words."""
    shape = shape_of(row)
    words = ["no array" if shape is None else f"shape {shape} {dtype_of(row)}"]
    for name, value in (("op", _op_name(row[4]) if row[4] >= 0 else None),
                        ("root", row[5] if row[5] >= 0 else None),
                        ("axis", row[6] if row[6] >= 0 else None)):
        if value is not None:
            words.append(f"{name} {value}")
    return ", ".join(words)


def exchange(comm, x, name, op=None, root=None, axis=None, same_axis=True, none_ok=()):
    """All-gather every rank's descriptor and check they belong together.

    Returns the (size, DESC_LEN) table, so callers can read other ranks' shapes (the
    all-gather's piece lengths, the broadcast root's shape). Raises MismatchError on
    every rank alike. `same_axis=False` lets the length along `axis` differ;
    `none_ok` lists ranks allowed to pass no array (non-roots of a broadcast).
    """
    mine, table = post(comm, x, op, root, axis)
    comm.Allgather(mine, table)
    return verify(table, name, same_axis, none_ok)


def post(comm, x, op=None, root=None, axis=None):
    """(my descriptor, an empty table for everyone's): the buffers of the all-gather."""
    problem = local_problem(x, op, axis, root, comm.Get_size())
    if not problem and axis is not None and x is not None:
        axis %= x.ndim                    # -1 and ndim-1 are the same axis
    mine = describe(x, op, root, axis, problem)
    stats.add_check(sent=mine.nbytes, recv=mine.nbytes * (comm.Get_size() - 1))
    return mine, np.empty((comm.Get_size(), DESC_LEN), dtype=np.int64)


def verify(table, name, same_axis=True, none_ok=()):
    """Compare the gathered descriptors; every rank compares the same table, so every
    rank reaches the same verdict."""
    for r, row in enumerate(table):
        if row[0]:
            raise MismatchError(f"{name}: rank {r} passed {_text(row)}: {PROBLEMS[row[0]]}")
    first = next((r for r in range(len(table)) if r not in none_ok or table[r, 1] >= 0), 0)
    ref = table[first]
    for r, row in enumerate(table):
        if r in none_ok and row[1] < 0:
            continue
        if row[1] < 0:
            raise MismatchError(f"{name}: rank {r} passed no array")
        same = row.copy()
        if not same_axis and row[1] == ref[1] and 0 <= row[6] < row[1]:
            same[7 + row[6]] = ref[7 + row[6]]     # the length along axis may differ
        if not np.array_equal(same[1:], ref[1:]):
            what = ("op" if row[4] != ref[4] else "root" if row[5] != ref[5]
                    else "axis" if row[6] != ref[6] else "input")
            raise MismatchError(
                f"{name}: ranks disagree on the {what}: rank {first} has {_text(ref)}; "
                f"rank {r} has {_text(row)}")
    return table


def _op_name(code):
    return OPS[code] if 0 <= code < len(OPS) else "-"


def agree(comm, ok):
    """True on every rank when `ok` is true on every rank: one MPI Allreduce of one int.

    The lesson harness uses it to turn an error seen by some ranks into one all see.
    Counted under "check".
    """
    flag = np.array([0 if ok else 1], dtype=np.int64)
    total = np.empty_like(flag)
    comm.Allreduce(flag, total, op=MPI.SUM)
    stats.add_check(sent=flag.nbytes, recv=flag.nbytes)
    return int(total[0]) == 0
