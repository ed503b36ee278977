"""The hand-written all-reduces beside MPI's own, in the table nccl-tests prints.

    mpirun -n 4 python -m minidist.bench collectives --calibrate   # once: alpha, beta, gamma
    mpirun -n 4 python -m minidist.bench collectives -b 8 -e 64M -f 8 --json rows.json
    mpirun -n 4 python -m minidist.bench collectives -f 2 --crossovers   # all three, measured

For each size M from --min-bytes to --max-bytes (times --factor): count and type of the
elements, then the time of one all-reduce (median over --iters calls of the slowest rank's
time, after --warmup calls) and busbw = M / time x 2(N-1)/N as nccl-tests defines it
(NVIDIA/nccl-tests doc/PERFORMANCE.md), for minidist's ring, for all_reduce(algorithm=
"auto") with the algorithm it picked, and for MPI's own Allreduce; then ring / MPI and
auto / MPI. The hand-written ones run with check=False: the algorithm alone, without the
small shape-agreement message. All are called in turn on every iteration, so a noisy
neighbour slows them alike.

auto picks by the alpha-beta model (minidist/comm/tuning.py) with the constants that
--calibrate measured and stored, or round defaults when none are stored; the header names
which, and the sizes where the model's choice changes. --crossovers also times recursive
doubling and Rabenseifner alone and prints where each pair's faster one changes, measured
beside the model's prediction.
"""
import argparse
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from minidist import cli
from minidist.comm import all_reduce, mpi_all_reduce, ring_all_reduce, tuning
from minidist.plan.collectives import BUS_FACTOR

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
SHORT = {"ring": "ring", "recursive_doubling": "rdbl", "rabenseifner": "rabn"}


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


def library():
    """The MPI library's first line, spaces squeezed: 'MPICH Version: 5.0.2'."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def sizes(lo, hi, factor):
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= factor
    return out


def print_crossovers(say, n, constants, sizes_, times):
    """Each pair's crossover, the model's (from constants) beside the measured (from times)."""
    from minidist.plan.collectives import crossover
    a, b, g = constants["alpha"], constants["beta"], constants["gamma"]
    say("# crossovers, pair by pair: below M the first is faster, above it the second")
    for lo, hi in tuning.PAIRS:
        model = crossover(lo, hi, n, a, b, g)
        seen = tuning.measured_crossover(sizes_, times[lo], times[hi])
        say(f"#   {lo} -> {hi}: model {tuning.describe(model)}, measured {tuning.describe(seen)}"
            f"{tuning.ratio_words(model, seen)}")


def build_parser():
    p = cli.parser(__doc__.split("\n\n")[0], steps=None, dtype="float32")
    p.prog = "python -m minidist.bench collectives"
    p.add_argument("--min-bytes", "-b", type=parse_bytes, default=8, help="smallest message (default 8)")
    p.add_argument("--max-bytes", "-e", type=parse_bytes, default=64 * 2**20, help="largest (default 64M)")
    p.add_argument("--factor", "-f", type=cli.positive_int, default=2,
                   help="size multiplier between rows, 2 or more (default 2)")
    p.add_argument("--iters", "-n", type=cli.positive_int, default=10,
                   help="timed calls per size")
    p.add_argument("--warmup", "-w", type=cli.nonnegative_int, default=5,
                   help="untimed calls first, at each size (default 5)")
    p.add_argument("--calibrate", action="store_true",
                   help=f"measure alpha, beta, gamma, store them ({tuning.ENV} or the cache "
                        "dir), stop")
    p.add_argument("--crossovers", action="store_true",
                   help="also time recursive doubling and Rabenseifner; print measured crossovers")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    if args.calibrate and n < 2:
        p.error("--calibrate needs two ranks or more (it times messages between them)")
    problem = comm.bcast(cli.json_problem(args.json) if args.json and rank == 0 else None)
    if problem:
        p.error(problem)
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.calibrate:
        return calibrate(comm, say)

    plan = tuning.agreed(comm)
    dtype = np.dtype(args.dtype)
    busf = BUS_FACTOR["all_reduce"](n)
    say(f"# all-reduce (sum) of {dtype.name}, {n} ranks: minidist's ring and auto beside MPI's own "
        f"Allreduce")
    say(f"# MPI: {library()}")
    cores = os.cpu_count() or 1
    if n > cores:
        say(f"# warning: {n} ranks on {cores} cores (os.cpu_count()): ranks take turns on a core, so")
        say(f"#   the times include waiting for one and busbw understates the links (use -n {cores})")
    say(f"# time: median of {args.iters} calls (slowest rank) after {args.warmup} warm-up")
    say(f"# busbw in GB/s (1e9 bytes/s) = size / time x 2(N-1)/N = size / time x {busf:.3f}, as "
        f"nccl-tests")
    say(f"# auto: {tuning.plan_words(plan)}")
    say(f"#   alpha {plan['alpha'] * 1e6:.2f} us, beta {plan['beta'] * 1e9:.4f} ns/B, "
        f"gamma {plan['gamma'] * 1e9:.4f} ns/B")
    say(f"#   from {plan['source']}")
    say("#   (rdbl = recursive doubling, rabn = Rabenseifner)")
    say(f"# {'':>10} {'':>10} {'- minidist ring -':>16} {'--- minidist auto ---':>22} "
        f"{'- MPI Allreduce -':>16} {'ring/MPI':>8} {'auto/MPI':>8}")
    say(f"# {'size':>10} {'count':>10} {'time':>9} {'busbw':>6} {'time':>9} {'busbw':>6} {'algo':>5} "
        f"{'time':>9} {'busbw':>6} {'time':>8} {'time':>8}")
    say(f"# {'(B)':>10} {'(elements)':>10} {'(us)':>9} {'(GB/s)':>6} {'(us)':>9} {'(GB/s)':>6} {'':>5} "
        f"{'(us)':>9} {'(GB/s)':>6}")
    rng = np.random.default_rng([args.seed, rank])
    rows, measured = [], []
    for size in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = max(1, size // dtype.itemsize)
        nbytes = count * dtype.itemsize
        x = rng.standard_normal(count).astype(dtype)
        iters = args.iters if nbytes < 2**25 else max(3, args.iters // 2)   # keep the 32M+ rows short
        calls = {"ring": lambda: ring_all_reduce(comm, x, check=False),
                 "auto": lambda: all_reduce(comm, x, algorithm="auto", check=False),
                 "mpi": lambda: mpi_all_reduce(comm, x)}
        if args.crossovers:
            calls.update({k: (lambda k=k: all_reduce(comm, x, algorithm=k, check=False))
                          for k in ("recursive_doubling", "rabenseifner")})
        t = tuning.slowest_medians(comm, calls, iters, args.warmup)
        picked = tuning.choose(comm, nbytes)
        bw = {k: nbytes / t[k] / 1e9 * busf for k in t}
        say(f"  {nbytes:>10} {count:>10} {t['ring'] * 1e6:9.1f} {bw['ring']:6.2f} "
            f"{t['auto'] * 1e6:9.1f} {bw['auto']:6.2f} {SHORT[picked]:>5} {t['mpi'] * 1e6:9.1f} "
            f"{bw['mpi']:6.2f} {t['ring'] / t['mpi']:8.3g} {t['auto'] / t['mpi']:8.3g}")
        rows.append({"size_bytes": nbytes, "count": count, "dtype": dtype.name,
                     **{f"{k}_us": v * 1e6 for k, v in t.items()}, "auto_algorithm": picked})
        measured.append(t)
    say("# ring/MPI or auto/MPI below 1: the hand-written one was faster.")
    if args.crossovers:
        times = {k: [t[k] for t in measured] for k in tuning.ALGORITHMS}
        print_crossovers(say, n, plan, [r["size_bytes"] for r in rows], times)
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"world_size": n, "mpi": library(),
                       "constants": {k: plan[k] for k in ("alpha", "beta", "gamma", "source")},
                       "auto_plan": plan["plan"], "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


def calibrate(comm, say):
    """Measure alpha, beta, gamma here; rank 0 stores them; print them and the model's plan."""
    n = comm.Get_size()
    constants = tuning.calibrate(comm)
    where = tuning.save(constants, n, library()) \
        if comm.Get_rank() == 0 else None
    comm.Barrier()                      # stored before any rank reads it
    say(f"calibrated on {n} ranks: alpha {constants['alpha'] * 1e6:.3g} us per message, "
        f"beta {constants['beta'] * 1e9:.3g} ns/B, gamma {constants['gamma'] * 1e9:.3g} ns/B")
    say(f"stored in {where}")
    from minidist.plan.collectives import cheapest, crossovers
    a, b, g = constants["alpha"], constants["beta"], constants["gamma"]
    steps = [(m, faster) for m, _, faster in crossovers(n, a, b, g)]
    plan = {"plan": [(0, cheapest(0, n, a, b, g))] + steps}
    say(f"auto at {n} ranks: {tuning.plan_words(plan)}")
    return 0


if __name__ == "__main__":
    from minidist.failfast import agreed_exit
    agreed_exit(main())
