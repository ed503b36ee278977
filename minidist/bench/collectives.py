"""The hand-written ring all-reduce beside MPI's own, in the table nccl-tests prints.

    mpirun -n 4 python -m minidist.bench collectives
    mpirun -n 8 python -m minidist.bench collectives --min-bytes 1M --max-bytes 16M --iters 20

For each size M from --min-bytes to --max-bytes (times --factor): count and type of the
elements, the time of one all-reduce (median over --iters calls of the slowest rank's
time, after --warmup calls), algbw = M / time and busbw = algbw * 2(N-1)/N as
nccl-tests defines them (NVIDIA/nccl-tests doc/PERFORMANCE.md), first for
minidist.comm.ring_all_reduce (check=False: the algorithm alone, without the small
shape-agreement message), then for MPI's own Allreduce, and the ratio ring / MPI.
The two are called in turn on every iteration, so a noisy neighbour slows both alike.

Expect the ring to lose at small sizes (2(N-1) messages, each paying the latency) and
to come close to MPI, or beat it, at large ones (docs/reference.md#the-alpha-beta-cost-model).
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

from minidist.comm import mpi_all_reduce, ring_all_reduce

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text):
    """'8', '64K', '16M' -> bytes."""
    text = text.strip().upper().rstrip("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    try:
        return int(float(text[:len(text) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 8, 64K or 16M, got {text!r}")


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024


def time_both(comm, x, iters, warmup):
    """Median of the slowest rank's time for the ring and for MPI, called in turn."""
    calls = {"ring": lambda: ring_all_reduce(comm, x, check=False), "mpi": lambda: mpi_all_reduce(comm, x)}
    times = {k: [] for k in calls}
    for i in range(warmup + iters):
        for name, call in calls.items():
            comm.Barrier()
            t0 = MPI.Wtime()
            call()
            t = np.array([MPI.Wtime() - t0])
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)     # a collective ends with its slowest rank
            if i >= warmup:
                times[name].append(t[0])
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidist.bench collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", "-b", type=parse_bytes, default=8, help="smallest message (default 8)")
    p.add_argument("--max-bytes", "-e", type=parse_bytes, default=64 * 2**20, help="largest (default 64M)")
    p.add_argument("--factor", "-f", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("--iters", "-n", type=int, default=10, help="timed calls per size (default 10)")
    p.add_argument("--warmup", "-w", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    dtype = np.dtype(args.dtype)
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.factor < 2 or args.iters < 1 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        say("error: need --factor >= 2, --iters >= 1 and 1 <= --min-bytes <= --max-bytes", file=sys.stderr)
        return 2

    busf = 2 * (n - 1) / n
    say(f"# all-reduce (sum), {n} ranks: minidist ring (Sendrecv of chunks) vs MPI's own Allreduce "
        f"({MPI.Get_library_version().splitlines()[0].strip()})")
    say(f"# time: median of {args.iters} calls (slowest rank) after {args.warmup} warm-up; "
        f"algbw = size / time; busbw = algbw x 2(N-1)/N = algbw x {busf:.3f}")
    say("#")
    say(f"# {'':>10} {'':>10} {'':>7} {'--------- minidist ring ---------':>34} "
        f"{'-------- MPI Allreduce ---------':>34}")
    say(f"# {'size':>10} {'count':>10} {'type':>7} {'time(us)':>10} {'algbw':>11} {'busbw':>11} "
        f"{'time(us)':>10} {'algbw':>11} {'busbw':>11} {'ring/MPI':>9}")
    say(f"# {'(B)':>10} {'(elements)':>10} {'':>7} {'':>10} {'(GB/s)':>11} {'(GB/s)':>11} "
        f"{'':>10} {'(GB/s)':>11} {'(GB/s)':>11} {'time':>9}")
    size = args.min_bytes
    rng = np.random.default_rng(rank)
    while size <= args.max_bytes:
        count = max(1, size // dtype.itemsize)
        nbytes = count * dtype.itemsize
        x = rng.standard_normal(count).astype(dtype)
        iters = args.iters if nbytes < 2**25 else max(3, args.iters // 2)   # keep the 32M+ rows short
        t = time_both(comm, x, iters, args.warmup)
        cells = []
        for name in ("ring", "mpi"):
            algbw = nbytes / t[name] / 1e9
            cells.append(f"{t[name] * 1e6:10.1f} {algbw:11.3f} {algbw * busf:11.3f}")
        say(f"  {nbytes:>10} {count:>10} {dtype.name:>7} {cells[0]} {cells[1]} {t['ring'] / t['mpi']:9.2f}")
        size *= args.factor
    say("# ring/MPI below 1: the hand-written ring was faster.")
    return 0


if __name__ == "__main__":
    from minidist.failfast import agreed_exit
    agreed_exit(main())
