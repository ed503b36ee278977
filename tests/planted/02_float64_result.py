"""average_gradients averaging "to be safe" in float64: g.astype(float) before the ring.
Right values in float64; in float32 every message and every averaged gradient is twice
the size, and lesson 02 in float32 would hand float64 gradients to a float32 model."""
from minidist.comm import ring_all_reduce

EXPECT = {"2.1": "is float64, the gradients are float32: keep their dtype"}
RANKS = 3


def average_gradients(comm, grads):
    n = comm.Get_size()
    return [ring_all_reduce(comm, g.astype(float), op="sum") / n for g in grads]
