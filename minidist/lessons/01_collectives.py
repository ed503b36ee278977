"""Lesson 01: collectives written by hand on point-to-point messages, measured.

    mpirun -n 4 python -m minidist.lessons.01_collectives
    mpirun -n 3 python -m minidist.lessons.01_collectives --size-mib 4 --json out.json
    mpirun -n 4 python -m minidist.grade lessons/exercises/01_collectives.py

It draws the ring for this world step by step, runs every collective of minidist.comm
on an array whose length does not divide by N and compares each with one process's
answer and with MPI's own, then times them on --size-mib MiB and prints bytes sent per
rank (measured beside the formula of docs/reference.md#collectives), messages, time and
bus bandwidth. It ends with the alpha-beta model (docs/reference.md#the-alpha-beta-cost-model):
why the ring wins for large arrays and loses for tiny ones.

Nothing here trains: the report's "parallel" and "steps" are null, "match" means every
collective agreed with one process and every byte count equalled its formula.

On a device (MINIDIST_DEVICE=cuda, or strict: the CPU double of one) every collective is
given this rank's input on the device and gives its result back there; the copies it makes
through the host (minidist/comm/staging.py) are counted per call and priced over PCIe:
figures["host_device_bytes_per_call"] (0 on the CPU, where nothing crosses).
"""
import math
import os
import re

import numpy as np
from mpi4py import MPI

from minidist import transfers
from minidist.backend import DEVICE, on_device, to_device, to_numpy
from minidist.comm import (all_reduce, all_to_all, broadcast, chunk_bounds, mpi_all_reduce,
                           naive_all_reduce, rabenseifner_all_reduce,
                           recursive_doubling_all_reduce, reduce,
                           ring_all_gather, ring_all_reduce, ring_reduce_scatter, staging, stats,
                           tuning)
from minidist.lessons import harness
from minidist.lessons.harness import fmt_bytes, say
from minidist.plan.collectives import (ALL_REDUCE_TIMES, BUS_FACTOR, alpha_beta_terms, crossover,
                                       formulas, power_of_two_below)

# float32 sums of N numbers in another order differ by a few 1e-7 of the largest value;
# float64 by a few 1e-16. The bounds leave a margin of 10-100 and still catch a wrong chunk.
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


# ----------------------------------------------------------------------------- the picture

def ring_schedule(n):
    """The ring's steps as (phase, s, [(sender, chunk) for every rank]), s = 1 .. n-1.

    Reduce-scatter step s: rank r sends chunk (r - s) mod n to rank (r + 1) mod n, which
    adds its own piece. All-gather step s: rank r forwards chunk (r - s + 1) mod n, which
    the receiver keeps. (minidist/comm/collectives.py counts the same steps from 0.)
    """
    rs = [("reduce-scatter", s, [(r, (r - s) % n) for r in range(n)]) for s in range(1, n)]
    ag = [("all-gather", s, [(r, (r - s + 1) % n) for r in range(n)]) for s in range(1, n)]
    return rs + ag


def draw_ring(n):
    """Print the ring reduce-scatter and all-gather for n ranks, as a table per step.

    Rank r's own piece of a chunk is written with r's letter (a, b, c, ...); a cell lists
    the ranks whose pieces it holds summed ('all' when every rank's is in), '*' marks
    what arrived this step. Chunks are written #0, #1, ... so that no chunk is mistaken
    for a rank's letter. Returns what was drawn, for the tests: a list of
    (phase, s, [(sender, chunk, letters of the pieces sent)]) and the final table,
    held[rank][chunk] = set of letters.
    """
    letters = "abcdefghijklmnopqrstuvwxyz"[:n]
    held = [[{letters[r]} for _ in range(n)] for r in range(n)]     # held[rank][chunk]
    cell = lambda s: "all" if len(s) == n else "+".join(sorted(s))
    drawn = []

    def show(title, fresh):
        say(title)
        say("          " + "".join(f"{'chunk #' + str(c):<12}" for c in range(n)))
        for r in range(n):
            say(f"  rank {r}  " + "".join(f"{cell(held[r][c]) + ('*' if (r, c) in fresh else ''):<12}"
                                          for c in range(n)))

    show(f"start: rank r holds its own array (letter r), cut into {n} chunks, #0 to #{n - 1}", set())
    for phase, s, sent in ring_schedule(n):
        moves = ", ".join(f"{r}->{(r + 1) % n}: #{c}" for r, c in sent)
        drawn.append((phase, s, [(r, c, frozenset(held[r][c])) for r, c in sent]))
        new = {((r + 1) % n, c): set(held[r][c]) for r, c in sent}     # everyone sends at once
        for (dest, c), pieces in new.items():
            held[dest][c] = held[dest][c] | pieces if phase == "reduce-scatter" else pieces
        if phase == "reduce-scatter":
            what = f"chunk #(r-{s}) mod {n} right; the receiver adds its own piece"
        else:
            which = f"#(r-{s - 1}) mod {n}" if s > 1 else "#r"
            what = f"chunk {which} right; the receiver keeps it"
        show(f"\n{phase} step {s} of {n - 1}: rank r sends {what}\n  ({moves})", set(new))
        if phase == "reduce-scatter" and s == n - 1:
            say("-> rank r now holds chunk #r summed over all ranks ('all'): that is reduce-scatter.")
    say(f"-> every rank holds every chunk summed: all-reduce in 2(N-1) = {alpha_beta_terms('ring', n)[0]} steps.\n")
    return drawn, held


# ----------------------------------------------------------------------------- the collectives

def key(label):
    """'all_reduce (recursive doubling)' -> 'all_reduce_recursive_doubling' (the JSON's keys)."""
    name, how = label.split(" ", 1)
    how = how.strip("()").replace("MPI's own", "mpi").replace(" ", "_")
    return name if how in ("ring", "linear", "pairwise") else f"{name}_{how}"


def cases(comm):
    """(label, this rank's input picked from all ranks' inputs, the call on it, the single-process
    answer from all ranks' inputs) for every collective."""
    n, r = comm.Get_size(), comm.Get_rank()
    mine, total = (lambda a: a[r]), (lambda a: np.sum(a, 0))
    return [
        ("all_reduce (ring)", mine, lambda x: ring_all_reduce(comm, x), total),
        ("all_reduce (naive)", mine, lambda x: naive_all_reduce(comm, x), total),
        ("all_reduce (recursive doubling)", mine, lambda x: recursive_doubling_all_reduce(comm, x),
         total),
        ("all_reduce (rabenseifner)", mine, lambda x: rabenseifner_all_reduce(comm, x), total),
        ("all_reduce (MPI's own)", mine, lambda x: mpi_all_reduce(comm, x), total),
        ("reduce_scatter (ring)", mine, lambda x: ring_reduce_scatter(comm, x),
         lambda a: np.array_split(np.sum(a, 0), n)[r]),
        ("all_gather (ring)", lambda a: np.array_split(a[r], n)[r], lambda x: ring_all_gather(comm, x),
         lambda a: np.concatenate([np.array_split(a[i], n)[i] for i in range(n)])),
        ("broadcast (linear)", mine, lambda x: broadcast(comm, x, root=0), lambda a: a[0]),
        ("reduce (linear)", mine, lambda x: reduce(comm, x, root=0),
         lambda a: np.sum(a, 0) if r == 0 else None),
        ("all_to_all (pairwise)", mine, lambda x: all_to_all(comm, x),
         lambda a: np.concatenate([np.array_split(a[i], n)[r] for i in range(n)])),
    ]


def on_this_device(a):
    """This rank's input where the model's arrays live: on the device (a counted copy) under
    MINIDIST_DEVICE=cuda or strict, the host array itself on the CPU."""
    return to_device(a)


def came_back(got, given):
    """(the result as a host array for comparing, whether it came back in the input's kind)."""
    if got is None:
        return None, True
    return to_numpy(got), on_device(got) == on_device(given)


def all_inputs(n, length, dtype, seed):
    """Every rank's input, made on every rank from the seed: the reference needs no messages."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, length)).astype(dtype)


def rel_to(got, want):
    if want is None:
        return 0.0 if got is None else float("inf")
    if got is None or got.shape != want.shape:
        return float("inf")
    return harness.rel_diff(got, want)[0]


def timed(comm, fn, repeats):
    """Median over repeats of the slowest rank's time for one call."""
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = MPI.Wtime()
        fn()
        t = np.array([MPI.Wtime() - t0])
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        times.append(t[0])
    return float(np.median(times))


def bytes_needed(n, size_mib, dtype):
    """Bytes one rank holds for the timing part: every rank's input (made on every rank
    from the seed, through float64), plus results and buffers of a few M."""
    m = size_mib * 2**20
    return n * m * (1 + 8 / dtype.itemsize) + 6 * m


def check_memory(comm, size_mib, dtype):
    """--size-mib that this node's memory cannot hold is bad input, found before allocating."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)       # the ranks that share this machine
    ranks_here = local.Get_size()
    local.Free()
    need = ranks_here * bytes_needed(comm.Get_size(), size_mib, dtype)
    have = harness.physical_memory()
    harness.agreed_need(
        comm, have is None or need < 0.8 * have,
        f"--size-mib {size_mib:g} needs about {need / 2**30:.1f} GiB on this machine "
        f"({ranks_here} ranks, each holding all {comm.Get_size()} ranks' inputs), more than 80% of its "
        f"{(have or 0) / 2**30:.1f} GiB: choose a smaller --size-mib")


def max_over_ranks(comm, value):
    buf = np.array([value], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return buf[0]


def main(args):
    comm = harness.comm_world()
    n = comm.Get_size()
    dtype = np.dtype(args.dtype)
    check_memory(comm, args.size_mib, dtype)
    say(f"Lesson 01: collectives by hand on {n} rank{'s' * (n > 1)} (MPI point-to-point messages only)\n")
    if args.draw:
        draw_ring(min(n, 4) if n > 1 else 2)
        if n > 4:
            say(f"(drawn for 4 ranks; with {n} it is the same pattern, {n - 1} steps per phase)\n")

    # 1. correct? an odd length, so chunks are uneven, against one process and against MPI
    length = 1000 * n + 3
    xs = all_inputs(n, length, dtype, args.seed)
    errors, worst_abs, kinds_ok = {}, 0.0, True
    for label, pick, run, want in cases(comm):
        x = on_this_device(pick(xs))
        got, same_kind = came_back(run(x), x)
        kinds_ok = kinds_ok and same_kind
        errors[label] = rel_to(got, want(xs))
        if got is not None and want(xs) is not None:
            worst_abs = max(worst_abs, float(np.max(np.abs(got - want(xs)), initial=0.0)))
    mpi = mpi_all_reduce(comm, xs[comm.Get_rank()])
    errors["all_reduce (ring) vs MPI's own"] = rel_to(ring_all_reduce(comm, xs[comm.Get_rank()]), mpi)
    for k in errors:
        errors[k] = max_over_ranks(comm, errors[k])
    worst_abs = max_over_ranks(comm, worst_abs)
    say(f"correctness: {length} {dtype.name} per rank (uneven chunks), each collective against one process")
    harness.table([[k, f"{v:.1e}", "ok" if v <= TOLERANCE[dtype.name] else "WRONG"] for k, v in errors.items()],
                  header=["collective", "max_rel_diff", ""])

    # 2. how much and how fast: one call each on M bytes (M divisible by N and P: formulas exact)
    unit = math.lcm(n, power_of_two_below(n))
    count = max(unit, int(args.size_mib * 2**20 / dtype.itemsize) // unit * unit)
    big = all_inputs(n, count, dtype, args.seed + 1)
    M = count * dtype.itemsize
    expect = formulas(n, M)
    measured, staged, rows = {}, {}, []
    for label, pick, call, _ in cases(comm):
        x = on_this_device(pick(big))
        run = lambda x=x, call=call: call(x)      # noqa: E731  (this rank's input, where it lives)
        before = transfers.snapshot()
        with stats.measure() as m:
            got = run()
        after = transfers.snapshot()
        copied = (after["h2d"] - before["h2d"]) + (after["d2h"] - before["d2h"])
        # staged, a call copies its input home and its result back: in + out bytes
        in_out = x.nbytes + (0 if got is None else got.nbytes) if staging_here(x) else 0
        staged[label] = (int(max_over_ranks(comm, copied)), int(max_over_ranks(comm, in_out)))
        name = label.split(" ")[0]
        data = {k: v for k, v in m.items() if k != "check"}
        sent = max_over_ranks(comm, sum(v["bytes_sent"] for v in data.values()))
        msgs = max_over_ranks(comm, sum(v["messages"] for v in data.values()))
        t = timed(comm, run, args.repeats)
        algbw = M / t / 1e9
        busbw = algbw * BUS_FACTOR[name](n) if n > 1 else 0.0
        measured[label] = None if "MPI" in label else int(sent)
        hidden = "unseen*"  # MPI's own messages never pass through minidist's counters
        rows.append([label, fmt_bytes(sent) if measured[label] is not None else hidden,
                     fmt_bytes(expect[label]) if expect[label] is not None else "-",
                     int(msgs) if measured[label] is not None else "-",
                     f"{t * 1e3:.2f}", f"{algbw:.2f}", f"{busbw:.2f}"])
    say(f"\none call each on M = {fmt_bytes(M)} ({count} {dtype.name}), busiest rank, median of {args.repeats}")
    harness.table(rows, header=["collective", "sent/rank", "formula", "msgs", "ms", "algbw GB/s", "busbw GB/s"])
    say("  algbw = M / time; busbw = algbw x 2(N-1)/N (all-reduce), (N-1)/N (reduce-scatter, all-gather,")
    say("  all-to-all), 1 (broadcast, reduce): nccl-tests' convention, comparable across N.")
    say("  * MPI's own all-reduce moves its bytes inside the library, where minidist cannot count them;")
    say(f"    its algorithm is {mpi_library()}'s choice for this size, not necessarily a ring")
    say("    (docs/reference.md#the-alpha-beta-cost-model).")

    staged_ok = where_the_transfers_are(staged, M)

    # 3. the alpha-beta model with this machine's alpha, beta and gamma: which algorithm when
    figures = alpha_beta(comm, n, M, args.repeats) or {}
    figures["host_device_bytes_per_call"] = {key(k): v[0] for k, v in staged.items()}

    tol = TOLERANCE[dtype.name]
    worst = max(errors.values())
    bytes_ok = all(measured[k] == expect[k] for k in measured if measured[k] is not None)
    verb = "equal" if bytes_ok else "DIFFER FROM"
    say(f"\nmeasured bytes {verb} the formulas (M divides by N and P)")
    agreed_kinds = max_over_ranks(comm, 0.0 if kinds_ok else 1.0) == 0.0
    if not agreed_kinds:
        say("a collective returned a host array for a device input, or the reverse: WRONG")
    report = harness.new_report(
        "01_collectives", args, steps=None,
        match=bool(worst <= tol and bytes_ok and agreed_kinds and staged_ok), max_rel_diff=worst, max_abs_diff=worst_abs, tolerance=tol,
        comm={"bytes_sent": {key(k): v for k, v in measured.items() if v is not None},
              "expected_bytes": {key(k): v for k, v in expect.items() if v is not None}},
        figures=figures)
    return harness.finish(report, args)


# ----------------------------------------------------------------------------- the host <-> device copies

# What a copy between host and device costs, per direction: figures of the hardware, not
# measured here. PCIe 4.0 x16 moves 16 GT/s x 16 lanes, 128b/130b encoded: 31.5 GB/s each way
# (PCI-SIG's rate; NVIDIA's A100 datasheet: "PCIe Gen4: 64 GB/s", both ways together); PCIe
# 5.0 doubles it (H100 SXM datasheet: "PCIe Gen5: 128 GB/s"). 25 GB/s is this lesson's round
# figure for what one copy reaches of the 31.5.
PCIE4_BYTES_PER_S = 25e9


def staging_here(x):
    """True when a collective given x copies it through the host (minidist/comm/staging.py)."""
    return on_device(x) and not staging.DIRECT


def where_the_transfers_are(staged, M):
    """Print the host <-> device bytes each call copied (busiest rank) beside in + out, and
    their time over PCIe 4.0 x16. Returns True when every count equals its formula."""
    ok = all(copied == in_out for copied, in_out in staged.values())
    if DEVICE == "cpu":
        say("\n(on a device each call would also copy its input to the host and its result back:")
        say(" run with MINIDIST_DEVICE=strict to count them; on the CPU nothing crosses)")
        return ok
    how = "direct: MPI reads device memory" if staging.DIRECT else "staged through the host"
    say(f"\nhost <-> device copies per call on M = {fmt_bytes(M)}, busiest rank ({how})")
    harness.table([[label, fmt_bytes(copied), fmt_bytes(in_out), f"{copied / PCIE4_BYTES_PER_S * 1e6:.1f}"]
                   for label, (copied, in_out) in staged.items()],
                  header=["collective", "copied", "in + out", "us at 25 GB/s"])
    say("  MPI here moves host memory only: a device array comes to the host (device to host) and")
    say("  the result goes back (host to device), in + out bytes per call, over PCIe on most")
    say("  machines. PCIe 4.0 x16 carries 31.5 GB/s each way (PCI-SIG's rate; 5.0 doubles it); the")
    say("  last column prices the copies at 25 GB/s, this lesson's round figure for one copy. These")
    say("  are figures of the hardware, not measured here. A CUDA-aware MPI (or NCCL) reads device")
    say("  memory itself, over NVLink inside a node (H100 SXM: 900 GB/s, both ways together, in")
    say("  NVIDIA's datasheet) and GPUDirect RDMA between nodes: no copies (staging.py's direct path).")
    say(f"copies {'equal' if ok else 'DIFFER FROM'} in + out for every collective")
    return ok


def mpi_library():
    """The MPI library running this job, in a few words: 'MPICH 5.0.2', 'Open MPI v5.0.11'."""
    text = MPI.Get_library_version()
    m = re.match(r"\s*(MPICH) Version:\s*(\S+)", text) or re.match(r"\s*(Open MPI) (v?[\d.]+)", text)
    return f"{m.group(1)} {m.group(2)}" if m else (text.split(",")[0].strip() or "this MPI")


SHORT = {"ring": "ring", "rabenseifner": "Rabenseifner", "recursive_doubling": "rec. doubling"}
TINY = {"ring": "ring", "rabenseifner": "Raben.", "recursive_doubling": "rec.dbl"}


def alpha_beta(comm, n, M, repeats):
    """The three all-reduces' costs by the alpha-beta model, with alpha, beta and gamma
    calibrated now (minidist.comm.tuning.calibrate: a fit to a first timing of the three),
    beside their times measured a second time, from 8 B to M; then, pair by pair, the size
    where the faster one changes: the model's and the measured. Returns the figures for
    the report."""
    if n < 2:
        say("\n(alpha-beta model: needs two ranks)")
        return None
    c = tuning.calibrate(comm, big=M, repeats=max(repeats, 3))
    a, b, g = c["alpha"], c["beta"], c["gamma"]
    p2 = power_of_two_below(n)
    ring, rab, rd = (alpha_beta_terms(k, n) for k in ("ring", "rabenseifner", "recursive_doubling"))
    say(f"\nalpha-beta model, N = {n}, P = {p2} (Thakur, Rabenseifner and Gropp 2005;")
    say("docs/reference.md#the-alpha-beta-cost-model): "
        "a per message, b per byte sent, g per byte added")
    say(f"  ring           2(N-1) a + 2(N-1)/N M b + (N-1)/N M g  = {ring[0]} a + "
        f"{ring[1]:.2f} M b + {ring[2]:.2f} M g")
    say(f"  Rabenseifner   2 lg P a + 2(P-1)/P M b + (P-1)/P M g  = {rab[0]} a + "
        f"{rab[1]:.2f} M b + {rab[2]:.2f} M g")
    say(f"  rec. doubling  lg P (a + M b + M g)                   = {rd[0]} (a + M b + M g)")
    if n != p2:
        ranks = f"{n - p2} rank{'s' * (n - p2 > 1)}"
        say(f"  and both of the last two fold {ranks} in first and out at the end: "
            "+ 2 a + 2 M b + M g")
    rate = lambda s: f"{1 / s / 1e9:.2f} GB/s" if s > 0 else "too fast to see here"
    say(f"  here: a = {a * 1e6:.1f} us per message, b = {b * 1e9:.3f} ns per byte sent ({rate(b)}),")
    say(f"  g = {g * 1e9:.3f} ns per byte added ({rate(g)}); a and b fitted to a first timing of the")
    say(f"  three, which also finds c = {c['call'] * 1e6:.0f} us a call costs whatever it sends: in every "
        "measured")
    say("  time below (timed a second time), not in the model's.")
    sizes = [m for m in (8 * 4 ** k for k in range(20)) if m < M] + [M]
    names = ("ring", "rabenseifner", "recursive_doubling")
    times = {k: [] for k in names}
    rows = []
    for m in sizes:
        x = np.ones(max(1, m // 4), np.float32)
        got = tuning.slowest_medians(comm, {k: (lambda k=k: _run(k, comm, x)) for k in names},
                                     repeats)
        model = {k: ALL_REDUCE_TIMES[k](x.nbytes, n, a, b, g) for k in names}
        for k in names:
            times[k].append(got[k])
        best = lambda t: TINY[min(t, key=t.get)]
        rows.append([fmt_bytes(x.nbytes)]
                    + [f"{model[k] * 1e3:.3f} / {got[k] * 1e3:.3f}" for k in names]
                    + [f"{best(model)} / {best(got)}"])
    harness.table(rows, header=["M", "ring ms (model / measured)", "Rabenseifner", "rec. doubling",
                                "fastest"])
    say("  crossovers: below M the first is faster, above it the second")
    cross, agree = {}, []
    rows = []
    for lo, hi in tuning.PAIRS:
        model = crossover(lo, hi, n, a, b, g)
        seen = tuning.measured_crossover(sizes, times[lo], times[hi])
        ratio = model / seen if model is not None and seen is not None else None
        beyond = seen is None and (model is None or model > sizes[-1])   # none seen, none due
        if not beyond:
            agree.append(ratio is not None and 0.5 <= ratio <= 2)
        cross[f"{lo}->{hi}"] = {"model_bytes": model, "measured_bytes": seen}
        rows.append([f"{SHORT[lo]} -> {SHORT[hi]}", tuning.describe(model),
                     f"none up to {fmt_bytes(sizes[-1])}" if seen is None else tuning.describe(seen),
                     "-" if ratio is None else f"{ratio:.2f}"])
    harness.table(rows, header=["pair", "model", "measured", "model/measured"])
    plan = tuning.agreed(comm)
    say(f"  algorithm='auto' picks: {tuning.plan_words(plan)}")
    say(f"    (constants: {plan['source']})")
    say(f"crossovers: the model's within 2x of the measured for {sum(agree)} of {len(agree)} pairs "
        f"(those crossing by {fmt_bytes(sizes[-1])}).")
    if n > (os.cpu_count() or n):
        say(f"  Here {n} ranks share {os.cpu_count()} cores: ranks take turns on the CPU, so every message")
        say("  also waits for its receiver to be scheduled: measured times are noisy, and a crossover")
        say("  measured once can move by a factor of 2 in the next run.")
    return {"alpha_s": a, "beta_s_per_byte": b, "gamma_s_per_byte": g, "crossovers": cross}


def _run(name, comm, x):
    """One all-reduce by name, without the agreement check: the algorithm alone."""
    return all_reduce(comm, x, algorithm=name, check=False)


def build_parser():
    p = harness.parser(__doc__.split("\n\n")[0], steps=None, dtype="float32")
    p.add_argument("--size-mib", type=harness.positive_float, default=1.0,
                   help="MiB per rank for timing, more than 0 (default %(default)s)")
    p.add_argument("--repeats", type=harness.positive_int, default=5, help="timed calls per collective")
    p.add_argument("--no-draw", dest="draw", action="store_false", help="skip the step-by-step picture")
    return p


if __name__ == "__main__":
    harness.run(main, build_parser())
