"""Planted bug: the "ring" all-reduce calls MPI's own Allreduce."""
import numpy as np
from mpi4py import MPI



def ring_all_reduce(comm, x, op="sum"):
    out = np.empty_like(x)
    comm.Allreduce(np.ascontiguousarray(x), out, op=MPI.MAX if op == "max" else MPI.SUM)
    return out / comm.Get_size() if op == "avg" else out
