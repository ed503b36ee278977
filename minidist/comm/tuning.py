"""all_reduce(algorithm="auto"): the alpha-beta model picks ring, Rabenseifner or rec. doubling.

    mpirun -n 4 python -m minidist.bench collectives --calibrate   # measure alpha, beta, gamma
    mpirun -n 4 python -m minidist.bench collectives               # ring, auto and MPI side by side

The model (minidist/plan/collectives.py; Thakur, Rabenseifner and Gropp 2005) gives each
algorithm's time as a line in the message size M; the cheapest line wins, and the sizes
where the winner changes are the crossovers. Its three constants are this machine's:

    alpha   seconds per message (per round of an algorithm)
    beta    seconds per byte sent
    gamma   seconds per byte reduced: numpy.add of two 1 MiB float32 arrays, per byte

alpha and beta are fitted to the three algorithms timed from 8 B to 1 MiB (`calibrate`).

`calibrate` measures them; the bench's --calibrate stores them as JSON, one entry per world
size (ranks that share two cores wait for each other, so alpha depends on how many there
are), in $MINIDIST_CALIBRATION, else $XDG_CACHE_HOME/minidist/calibration.json, else
~/.cache/minidist/calibration.json. With nothing stored, DEFAULTS stand in: this project's
own round figures for ranks on one machine, not a measurement.

Every rank must pick the same algorithm, or they wait for messages that never come. The
choice is a function of M, N and the constants alone, and the constants are agreed once
per communicator: its rank 0 reads the file and sends them to the others (3 numbers,
counted under "check"); they are kept as an MPI attribute of the communicator, as the
non-blocking all-reduce keeps its tag counter.
"""
import json
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minidist.comm import stats
from minidist.comm.algorithms import rabenseifner_all_reduce, recursive_doubling_all_reduce
from minidist.comm.collectives import ring_all_reduce
from minidist.comm.watchdog import waiting

ENV = "MINIDIST_CALIBRATION"
DEFAULTS = {"alpha": 5e-6, "beta": 1e-10, "gamma": 1e-10}   # 5 us, 10 GB/s, 10 GB/s
TAG_CONSTANTS = 30017
_AGREED = MPI.Comm.Create_keyval()
_AGREED_ELSEWHERE = {}            # id(comm) -> (weakref, agreed): wrappers without attributes


# ----------------------------------------------------------------------------- the stored constants

def path():
    """Where the calibration lives (the file need not exist)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "minidist" / "calibration.json"


def load(world_size):
    """(constants, where from): the stored entry for this world size, else the stored one
    of the nearest world size, else DEFAULTS. A file that cannot be read is named, not hidden."""
    p = path()
    try:
        entries = json.loads(p.read_text())["by_world_size"]
        nearest = min(entries, key=lambda k: (abs(int(k) - world_size), int(k)))
        e = entries[nearest]
        constants = {k: float(e[k]) for k in DEFAULTS}
    except FileNotFoundError:
        return dict(DEFAULTS), "defaults (nothing stored)"
    except (ValueError, KeyError, TypeError, OSError) as err:
        return dict(DEFAULTS), f"defaults ({p} unreadable: {type(err).__name__})"
    return constants, f"{p}, measured at {nearest} ranks"


def save(constants, world_size, library=""):
    """Store one world size's constants beside the others already stored; returns the path."""
    p = path()
    try:
        data = json.loads(p.read_text())
        data["by_world_size"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        data = {"by_world_size": {}}
    entry = {k: float(constants[k]) for k in DEFAULTS}
    entry.update(measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), mpi=library)
    data["by_world_size"][str(world_size)] = entry
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(p)
    return p


# ------------------------------------------------------------------------- agreed per communicator

def agreed(comm):
    """{"alpha", "beta", "gamma", "source", "plan"}: rank 0's constants, the same on every rank
    of comm, and the model's plan for this N: [(from M bytes, algorithm)], by M."""
    get = getattr(comm, "Get_attr", None)
    if get is not None:
        found = get(_AGREED)
    else:
        ref, found = _AGREED_ELSEWHERE.get(id(comm), (lambda: None, None))
        found = found if ref() is comm else None
    if found is not None:
        return found
    found = _agree(comm)
    if get is not None:
        comm.Set_attr(_AGREED, found)
    else:
        import weakref
        _AGREED_ELSEWHERE[id(comm)] = (weakref.ref(comm), found)
    return found


def _agree(comm):
    """Rank 0 reads the stored constants and sends them to every other rank."""
    from minidist.plan.collectives import cheapest, crossovers
    size, rank = comm.Get_size(), comm.Get_rank()
    buf = np.zeros(4)
    source = ""
    if rank == 0:
        constants, source = load(MPI.COMM_WORLD.Get_size())
        buf[:3] = [constants[k] for k in DEFAULTS]
        buf[3] = source.startswith("defaults")
    with waiting("all_reduce(algorithm='auto')'s constants"):
        if rank == 0:
            for r in range(1, size):
                comm.Send(buf, r, TAG_CONSTANTS)
            stats.add_check(sent=buf.nbytes * (size - 1), messages=size - 1)
        else:
            comm.Recv(buf, 0, TAG_CONSTANTS)
            stats.add_check(recv=buf.nbytes, messages=0)
            source = "defaults" if buf[3] else "rank 0's stored calibration"
    alpha, beta, gamma = (float(v) for v in buf[:3])
    plan = [(0, cheapest(0, size, alpha, beta, gamma))]
    plan += [(m, faster) for m, _, faster in crossovers(size, alpha, beta, gamma)]
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "source": source, "plan": plan}


def choose(comm, nbytes):
    """The algorithm auto runs for an all-reduce of nbytes on comm (the same on every rank)."""
    plan = agreed(comm)["plan"]
    name = plan[0][1]
    for m, algorithm in plan[1:]:
        if nbytes < m:
            break
        name = algorithm
    return name


# ----------------------------------------------------------------------------- measuring them

def calibrate(comm, big=2**20, repeats=7):
    """alpha, beta, gamma for this machine, the same on every rank (needs two ranks or more).

    gamma is measured alone: numpy.add of two float32 arrays of `big` bytes, every rank at
    once, per byte. alpha and beta are the least-squares fit of the model's lines to the
    three algorithms themselves, timed (check=False) at M = 8 B, 32 B, ... up to `big`:

        t(algorithm, M) = c + A alpha + B beta + G gamma      (A, B, G: the model's counts)

    weighted by 1/t, so that 8 B and 1 MiB count alike; c, what a call costs whatever it
    sends (waking up after the barrier, Python's own work), is fitted too and returned as
    "call", but the model leaves it out: it is the same for every algorithm and moves no
    crossover. A fit, not a ping-pong: a round
    inside an all-reduce here costs more than one message in a quiet exchange (ranks that
    share cores wait to be scheduled between rounds, and above MPICH's eager limit, a few
    KiB here, every message waits for a handshake first), and what decides the crossovers
    is the cost of a round as the algorithms meet it. Up to 1 MiB by default: the
    crossovers fall below it, and past it the cost per byte grows (the arrays leave the
    caches), which one straight line cannot follow.
    """
    from minidist.plan.collectives import ALL_REDUCE_TIMES
    impls = {"recursive_doubling": recursive_doubling_all_reduce,
             "rabenseifner": rabenseifner_all_reduce, "ring": ring_all_reduce}
    size = comm.Get_size()
    a, b = np.ones(big // 4, np.float32), np.ones(big // 4, np.float32)
    gamma = slowest_medians(comm, {"add": lambda: np.add(a, b, out=a)}, repeats)["add"] / big
    rows, times = [], []
    m = 8
    while m <= big:
        x = np.ones(m // 4, np.float32)
        calls = {k: (lambda k=k: impls[k](comm, x, check=False)) for k in ALGORITHMS}
        got = slowest_medians(comm, calls, repeats, warmup=1)
        for k in ALGORITHMS:
            f = ALL_REDUCE_TIMES[k]
            rows.append([1.0, f(m, size, 1.0, 0.0), f(m, size, 0.0, 1.0)])
            times.append(got[k] - f(m, size, 0.0, 0.0, gamma))
        m *= 4
    A, t = np.array(rows), np.array(times)
    w = 1.0 / np.maximum(np.abs(t), 1e-9)
    (call, alpha, beta), *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    return {"alpha": max(float(alpha), 0.0), "beta": max(float(beta), 0.0), "gamma": gamma,
            "call": float(call)}


def slowest_medians(comm, calls, iters, warmup=0):
    """{name: median over iters of the slowest rank's time for one call}, the calls made in
    turn on every iteration, so a noisy neighbour slows them alike, in an order shuffled
    each iteration (the same on every rank), so none always follows the same other one."""
    times = {k: [] for k in calls}
    names = list(calls)
    for i in range(warmup + iters):
        for j in np.random.default_rng(i).permutation(len(names)):
            name = names[j]
            call = calls[name]
            comm.Barrier()
            t0 = MPI.Wtime()
            call()
            t = np.array([MPI.Wtime() - t0])
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)   # a collective ends with its slowest rank
            if i >= warmup:
                times[name].append(t[0])
    return {k: float(np.median(v)) for k, v in times.items()}


# ----------------------------------------------------------------------------- crossovers, in words

ALGORITHMS = ("recursive_doubling", "rabenseifner", "ring")
# (faster for small messages, faster for large ones), the model's expectation
PAIRS = (("recursive_doubling", "rabenseifner"), ("recursive_doubling", "ring"),
         ("rabenseifner", "ring"))


def measured_crossover(sizes, t_small, t_large):
    """Where t_large becomes and stays the faster: the last switch from t_small faster to
    t_large faster, placed between the two sizes where the time difference, a line in M
    between them, is zero. None when t_large is faster at every size or not at the largest."""
    faster = [b < a for a, b in zip(t_small, t_large)]
    if not faster or not faster[-1] or all(faster):
        return None
    i = max(k for k in range(len(faster)) if not faster[k]) + 1     # first of the last run
    d0, d1 = t_small[i - 1] - t_large[i - 1], t_small[i] - t_large[i]   # <= 0, > 0
    return sizes[i - 1] + (sizes[i] - sizes[i - 1]) * (-d0) / (d1 - d0)


def describe(m):
    """A crossover in words: '12.3 KiB', or 'none' for None."""
    if m is None:
        return "none"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if m < 1024 or unit == "GiB":
            return f"{m:.3g} {unit}" if m < 100 else f"{m:.0f} {unit}"
        m /= 1024


def ratio_words(model, measured):
    """' (model/measured 1.4)', or '' when either is missing; three figures at most
    ('1.26e+04'), so that a line of a noisy run stays within 100 columns."""
    if model is None or measured is None:
        return ""
    return f" (model/measured {model / measured:.3g})"


def plan_words(plan):
    """'recursive_doubling below 9.5 KiB, rabenseifner from there': the model's choice by M."""
    steps = plan["plan"]
    if len(steps) == 1:
        return f"{steps[0][1]} at every size"
    words = [f"{steps[0][1]} below {describe(steps[1][0])}"]
    for (m, name), nxt in zip(steps[1:], steps[2:] + [None]):
        words.append(f"{name} up to {describe(nxt[0])}" if nxt else f"{name} from there on")
    return ", ".join(words)
