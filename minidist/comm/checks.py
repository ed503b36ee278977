"""Agreement before data: every rank learns every rank's collective, shape, dtype, op and root.

A ring whose ranks disagree on the length sends chunks of different sizes and either
hangs or returns garbage; ranks that call different collectives (a ring on one rank, the
naive all-reduce on another) wait for messages that never come. So before moving data
each collective makes one small all-gather of a fixed-size descriptor (16 int64: 128
bytes per rank: which collective, the array's shape and dtype, op, root, axis) and
compares; a mismatch raises the same `MismatchError` on every rank, naming the ranks
that differ. This control message uses MPI's own Allgather and is counted under "check"
in minidist.comm.stats, apart from the data. Pass `check=False` to a collective to skip
it (the benchmark does, to time the algorithm alone): what a rank can see alone (an
unknown op, a dtype MPI cannot carry) is still refused, with the same error, by
`refuse`.

Also here: the reduction ops (sum, avg, max) as in-place NumPy ufuncs, `agree`, and
`wire`: bfloat16 (from the small ml_dtypes package; NumPy has no 16-bit brain float) is a
dtype the collectives carry and reduce like any float, but MPI has no type for it, so its
buffers travel as their raw 16-bit patterns (uint16 views); the reductions stay bf16.
"""
import zlib

import numpy as np
from mpi4py import MPI

from minidist.comm import staging, stats
from minidist.comm.watchdog import waiting
from minidist.failfast import AgreedError

DESC_LEN = 16        # [error, ndim, dtype char, itemsize, op, root, axis, kind, 8 dims]
MAX_DIMS = DESC_LEN - 8
OPS = ("sum", "avg", "max")
# the collectives, by the name their check uses; the descriptor carries a number for it
KINDS = ("ring_all_reduce", "naive_all_reduce", "recursive_doubling_all_reduce",
         "rabenseifner_all_reduce", "mpi_all_reduce", "ring_all_reduce_start",
         "ring_reduce_scatter", "ring_all_gather", "broadcast", "reduce", "all_to_all",
         "all_to_all_v", "send", "auto_all_reduce")


def is_bfloat16(dtype):
    """True for ml_dtypes' bfloat16 (kind 'V' to NumPy, but a float to every collective).
    The kind first: dtype.name alone costs microseconds, on every message."""
    return dtype.kind == "V" and dtype.name == "bfloat16"


def wire(buf):
    """The buffer MPI is handed: a bfloat16 array as its uint16 bit patterns, else buf itself.
    (Every buffer of minidist.comm's messages passes here; on the direct path a device
    buffer is first synchronized and counted: staging.hand_to_mpi.)"""
    staging.hand_to_mpi(buf)
    return buf.view(np.uint16) if is_bfloat16(buf.dtype) else buf


def kind_code(name):
    """A number for a collective's name, the same on every rank (a checksum of the name)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


_KIND_NAMES = {kind_code(n): n for n in KINDS}


class MismatchError(AgreedError):
    """Ranks called a collective with inputs that cannot belong together (raised on all)."""


def reduce_ufunc(op, xp=np):
    """The ufunc that combines two partial results: add for sum and avg (xp: the arrays'
    module, staging.namespace; NumPy's on the host)."""
    return xp.maximum if op == "max" else xp.add


def finish_avg(y, size):
    """avg = sum / size, in place (float and complex arrays only; checked before)."""
    y /= size
    return y


# problems a rank can see in its own input; the code travels in the descriptor so every
# rank can name the problem of every other rank
PROBLEMS = ("", "the op must be one of sum, avg, max",
            "op 'avg' needs a float or complex array (an integer average would be floored)",
            "MPI cannot carry this dtype (only native-order booleans, integers, floats and "
            "complex numbers; not strings, records, objects or byte-swapped arrays)",
            "a split along an axis needs an array of at least one dimension",
            "the axis is out of range", "the root is not a rank of this communicator",
            f"the check describes at most {MAX_DIMS} dimensions: reshape the array first",
            "op 'max' needs real numbers (complex numbers have no order)",
            "a reduction needs numbers, not booleans")


def local_problem(x, op=None, axis=None, root=None, size=None, described=True):
    """The code (index into PROBLEMS) of a problem this rank sees alone, or 0.

    `described=False`: no descriptor will carry the shape, so any number of dimensions does.
    """
    if op is not None and op not in OPS:
        return 1
    if root is not None and not 0 <= root < size:
        return 6
    if x is None:
        return 0
    if (x.dtype.kind not in "biufc" and not is_bfloat16(x.dtype)) or not x.dtype.isnative:
        return 3
    if op is not None and x.dtype.kind == "b":
        return 9
    if op == "avg" and x.dtype.kind not in "fc" and not is_bfloat16(x.dtype):
        return 2
    if op == "max" and x.dtype.kind == "c":
        return 8
    if described and x.ndim > MAX_DIMS:
        return 7
    if axis is not None and x.ndim == 0:
        return 4
    if axis is not None and not -x.ndim <= axis < x.ndim:
        return 5
    return 0


def refuse(comm, x, name, op=None, axis=None, root=None):
    """Raise this rank's own problem as the check would (for check=False: no message sent)."""
    problem = local_problem(x, op, axis, root, comm.Get_size(), described=False)
    if problem:
        row = describe(x, op, root, axis, problem, name)
        raise MismatchError(f"{name}: rank {comm.Get_rank()} passed {_text(row)}: {PROBLEMS[problem]}")


def describe(x, op=None, root=None, axis=None, problem=0, name=""):
    """This rank's descriptor: 16 int64 that say what it passed to which collective."""
    d = np.full(DESC_LEN, -1, dtype=np.int64)
    d[0] = problem
    d[4] = OPS.index(op) if op in OPS else -1
    d[5] = -1 if root is None else root
    d[6] = -1 if axis is None else axis
    d[7] = kind_code(name)
    if x is not None:
        d[1], d[2], d[3] = x.ndim, ord(x.dtype.char), x.dtype.itemsize
        d[8:8 + min(x.ndim, MAX_DIMS)] = x.shape[:MAX_DIMS]   # more: refused (problem 7)
    return d


def shape_of(row):
    """The shape a descriptor row describes (None when that rank passed no array)."""
    if row[1] < 0:
        return None
    return tuple(int(v) for v in row[8:8 + min(int(row[1]), MAX_DIMS)])


def dtype_of(row):
    if row[1] < 0:
        return None
    try:
        if chr(int(row[2])) == "E" and int(row[3]) == 2:      # bfloat16's letter
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(chr(int(row[2])))
    except (TypeError, ImportError):           # a dtype MPI cannot carry (refused): name it by its letter
        return chr(int(row[2]))


def _text(row):
    """'shape (4,) float32, op sum, axis 0': what a descriptor row says, in words."""
    shape = shape_of(row)
    if shape is not None and row[1] > MAX_DIMS:
        shape = f"({', '.join(str(n) for n in shape)}, ...) with {row[1]} dimensions"
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
    mine, table = post(comm, x, op, root, axis, name)
    gather(comm, mine, table, name)
    return verify(table, name, same_axis, none_ok)


def gather(comm, mine, table, name):
    """Every rank's descriptor into `table`: the one message the checks send with MPI's own
    Allgather (the grader's counting communicator allows it from this module only)."""
    with waiting(name):
        comm.Allgather(mine, table)


def post(comm, x, op=None, root=None, axis=None, name=""):
    """(my descriptor, an empty table for everyone's): the buffers of the all-gather."""
    problem = local_problem(x, op, axis, root, comm.Get_size())
    if not problem and axis is not None and x is not None:
        axis %= x.ndim                    # -1 and ndim-1 are the same axis
    mine = describe(x, op, root, axis, problem, name)
    stats.add_check(sent=mine.nbytes, recv=mine.nbytes * (comm.Get_size() - 1))
    return mine, np.empty((comm.Get_size(), DESC_LEN), dtype=np.int64)


def verify(table, name, same_axis=True, none_ok=()):
    """Compare the gathered descriptors; every rank compares the same table, so every
    rank reaches the same verdict."""
    for r, row in enumerate(table):
        if row[7] != table[0, 7]:     # a different collective, or another algorithm
            raise MismatchError(
                f"ranks called different collectives: rank 0 called {_kind(table[0, 7])}, "
                f"rank {r} called {_kind(row[7])}")
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
            same[8 + row[6]] = ref[8 + row[6]]     # the length along axis may differ
        if not np.array_equal(same[1:], ref[1:]):
            what = ("op" if row[4] != ref[4] else "root" if row[5] != ref[5]
                    else "axis" if row[6] != ref[6] else "input")
            raise MismatchError(
                f"{name}: ranks disagree on the {what}: rank {first} has {_text(ref)}; "
                f"rank {r} has {_text(row)}")
    return table


def _kind(code):
    return _KIND_NAMES.get(int(code), f"a collective with check code {int(code)}")


def _op_name(code):
    return OPS[code] if 0 <= code < len(OPS) else "-"


def agree(comm, ok):
    """True on every rank when `ok` is true on every rank: one MPI Allreduce of one int.

    The lesson harness uses it to turn an error seen by some ranks into one all see.
    Counted under "check".
    """
    flag = np.array([0 if ok else 1], dtype=np.int64)
    total = np.empty_like(flag)
    with waiting("agree"):
        comm.Allreduce(flag, total, op=MPI.SUM)
    stats.add_check(sent=flag.nbytes, recv=flag.nbytes)
    return int(total[0]) == 0
