"""A cheat: exercise 1.2 calls comm.Allgather from a function made in a namespace named
minidist.comm.checks, the one caller the grader's communicator allows Allgather (the
package's 128-byte shape check). The grader compares the caller's code object with that
module's own functions, not its module name, so the call is refused."""
import numpy as np

EXPECT = {"1.2": "called comm.Allgather"}

_space = {"__name__": "minidist.comm.checks", "np": np}
exec("def gather(comm, rows):\n"
     "    n = comm.Get_size()\n"
     "    table = np.empty((n,) + rows.shape, rows.dtype)\n"
     "    comm.Allgather(rows, table)\n"
     "    return table.reshape((-1,) + rows.shape[1:])\n", _space)


def ring_all_gather(comm, x, axis=0):
    rows = np.ascontiguousarray(np.moveaxis(np.asarray(x), axis, 0))
    return np.moveaxis(_space["gather"](comm, rows), 0, axis)
