"""all_reduce(algorithm="auto"): the alpha-beta model picks ring, Rabenseifner or recursive doubling.

    mpirun -n 4 python -m minidist.bench collectives --calibrate   # measure alpha, beta, gamma; store
    mpirun -n 4 python -m minidist.bench collectives               # ring, auto and MPI side by side

The model (minidist/plan/collectives.py; Thakur, Rabenseifner and Gropp 2005) gives each
algorithm's time as a line in the message size M; the cheapest line wins, and the sizes
where the winner changes are the crossovers. Its three constants are this machine's:

    alpha   seconds per message: one Sendrecv of 8 bytes, every rank exchanging with a
            partner at once (as in every round of the three algorithms)
    beta    seconds per byte sent: the same exchange of 4 MiB, less alpha, per byte
    gamma   seconds per byte reduced: numpy.add of two 4 MiB float32 arrays, per byte

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
from minidist.comm.watchdog import waiting

ENV = "MINIDIST_CALIBRATION"
DEFAULTS = {"alpha": 5e-6, "beta": 1e-10, "gamma": 1e-10}   # 5 us, 10 GB/s, 10 GB/s
TAG_CONSTANTS, TAG_CALIBRATE = 30017, 30018
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


# ----------------------------------------------------------------------------- agreed per communicator

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
    name = None
    for m, algorithm in agreed(comm)["plan"]:
        if nbytes < m:
            break
        name = algorithm
    return name


# ----------------------------------------------------------------------------- measuring them

def calibrate(comm, big=2**22, repeats=5):
    """alpha, beta, gamma measured here (see the docstring), the same on every rank: each
    is the median over `repeats` of the slowest rank's time. Needs two ranks or more."""
    size, rank = comm.Get_size(), comm.Get_rank()
    partner = rank ^ 1 if (rank ^ 1) < size else None        # pairs (0,1), (2,3), ... at once

    def slowest(fn, count):
        times = []
        for _ in range(repeats):
            comm.Barrier()
            t0 = MPI.Wtime()
            for _ in range(count):
                fn()
            t = np.array([(MPI.Wtime() - t0) / count])
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
            times.append(t[0])
        return float(np.median(times))

    def exchange(nbytes, count):
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        if partner is None:
            return slowest(lambda: None, count)
        return slowest(lambda: comm.Sendrecv(send, partner, TAG_CALIBRATE, recv, partner,
                                             TAG_CALIBRATE), count)

    alpha = exchange(8, 200)
    beta = max(exchange(big, 4) - alpha, 0.0) / big
    a, b = np.ones(big // 4, np.float32), np.ones(big // 4, np.float32)
    gamma = slowest(lambda: np.add(a, b, out=a), 4) / big
    return {"alpha": alpha, "beta": beta, "gamma": gamma}
