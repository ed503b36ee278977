"""This machine as the planner's cluster, for the time-scaled comparison (plan_measure.py):
what one rank of this CPU does while all ranks run (FLOP/s, memory bandwidth, the cost of
a message step), the planner's GPU and Cluster built from those figures and the link
model's links (minidist/comm/links.py), and where the simulated nodes put each rank.

Every function that measures is collective: all ranks call it, all get the same number
(the slowest rank's, or rank 0's).
"""
import time

import numpy as np
from mpi4py import MPI



def sustained_flops(comm, n=256, m=None, k=None, seconds=1.0, dtype="float32"):
    """FLOP/s per rank of (m x k) @ (k x n) products (square by default) while every rank
    of comm runs them at once.

    metrics.measure_peak_flops keeps the best single product, which fits inside one
    scheduler time slice and so sees a whole core; ranks that share cores get a share of
    them, which only a count over a long window sees. The mean over the ranks."""
    rng = np.random.default_rng(comm.Get_rank())
    m, k = m or n, k or n
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    out = np.empty((m, n), dtype)
    np.matmul(a, b, out=out)
    comm.Barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.matmul(a, b, out=out)
        count += 1
    mine = np.array([2.0 * m * k * n * count / (time.perf_counter() - start)])
    total = np.empty(1)
    comm.Allreduce(mine, total, op=MPI.SUM)
    return float(total[0]) / comm.Get_size()


def stream_bandwidth(comm, nbytes=8 << 20, seconds=0.5):
    """Memory bytes/s per rank of c = a + b on arrays of nbytes (3 nbytes moved each time),
    every rank of comm at once, the mean over ranks: the "HBM" of this CPU's GPU."""
    a, b = np.ones(nbytes // 8), np.ones(nbytes // 8)
    c = np.empty_like(a)
    comm.Barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.add(a, b, out=c)
        count += 1
    mine = np.array([3.0 * a.nbytes * count / (time.perf_counter() - start)])
    total = np.empty(1)
    comm.Allreduce(mine, total, op=MPI.SUM)
    return float(total[0]) / comm.Get_size()


def machine_alpha(comm, repeats=20):
    """Seconds per message step of this machine's own ring: a ring all-reduce of one float
    over comm (run() passes a LinkedComm without delays, so it waits as the layouts will),
    divided by its 2(N-1) steps, the slowest rank, the median of `repeats`. On ranks that
    share cores this is a scheduler's hand-over, not a wire: it joins the link model's
    alpha in the prediction."""
    from minidist.comm import ring_all_reduce
    n = comm.Get_size()
    if n == 1:
        return 0.0
    x, times = np.ones(1), []
    for _ in range(repeats + 2):
        comm.Barrier()
        t0 = time.perf_counter()
        ring_all_reduce(comm, x)
        took, slowest = np.array([time.perf_counter() - t0]), np.empty(1)
        comm.Allreduce(took, slowest, op=MPI.MAX)
        times.append(float(slowest[0]))
    return float(np.median(times[2:])) / (2 * (n - 1))


def megatron_placement(tp, pp, dp, per_node):
    """The simulated node of each world rank when the cluster numbers its GPUs in
    Megatron's order (tp, then dp, then pp: the order cost.py assumes) while lesson 07's
    grid numbers its ranks tp, then pp, then dp: the process at grid coordinates
    (d, p, t) sits on GPU p*dp*tp + d*tp + t, nodes holding per_node GPUs in blocks."""
    from minidist.comm.grid import grid_coords
    nodes = []
    for r in range(tp * pp * dp):
        d, p, t = grid_coords(r, tp, pp, dp)
        nodes.append((p * dp * tp + d * tp + t) // per_node)
    return nodes


def cpu_cluster(flops, hbm, links, alpha, itemsize, size, efficiency=1.0):
    """The planner's Cluster for the time-scaled machine: a GPU whose peak is this CPU's
    FLOP/s per rank (measured at the model's own matrix product) at `efficiency` (see
    efficiency()) and whose HBM is its memory bandwidth per rank; links as the link
    model's, bandwidths divided by its scale, each alpha plus this machine's own.

    The planner counts 16-bit activations and gradients (cost.ACT_BYTES; the ZeRO paper's
    2 + 2 bytes, Layout precision "zero"); the run moves itemsize-byte ones, so bandwidths
    (and HBM) are multiplied by ACT_BYTES / itemsize: the same seconds for the same message."""
    from minidist.plan.cluster import GPU, make_cluster
    from minidist.plan.cost import ACT_BYTES
    k = ACT_BYTES / itemsize
    (ia, ib), (ea, eb) = links.links["intra"], links.links["inter"]
    gpu = GPU("this-cpu", flops, 1e15, hbm * k, efficiency, ib / links.scale * k,
              eb / links.scale * k, "measured here: FLOP/s and memory bytes/s per rank at once")
    return make_cluster(None, size, links.per_node, intra_bw=gpu.intra_bw, intra_alpha=ia + alpha,
                        inter_bw=gpu.inter_bw, inter_alpha=ea + alpha, gpu=gpu)


def one_node(cluster):
    """The same GPUs in one node: for counting bytes. Across nodes the planner counts
    Megatron's scatter/gather of pipeline sends (each of the t ranks sends 1/t: Narayanan
    et al. 2021, section 4.1), which this engine does not do; inside a node the two agree."""
    from minidist.plan.cluster import make_cluster
    return make_cluster(None, cluster.gpus, cluster.gpus, gpu=cluster.gpu)
