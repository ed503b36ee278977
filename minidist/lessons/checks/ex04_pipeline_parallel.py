"""Checks for lessons/exercises/04_pipeline_parallel.py: two schedules and one exchange.

The schedules are graded by minidist.parallel.schedules, the referee: validate (every
action once, a backward after its forward, no rank waiting for ever), then the
simulator, whose bubble must equal the formula exactly and whose peak live activations
must be GPipe's m or 1F1B's min(p - r, m) on rank r, for p up to 8 and m up to 16. A
1F1B whose warm-up is off by one is still a valid order: its memory or its bubble gives
it away.

exchange runs on every rank with a CountingComm whose Send waits for its Recv, as MPI
allows any Send to: ranks pair up (0 with 1, 2 with 3, ...) and send to each other at
once, as two neighbouring stages do in 1F1B's steady state (activations forward,
gradients back). Two blocking sends facing each other never finish.
"""
import numpy as np

from minidist.lessons.checks import Exercise, own_session
from minidist.parallel import pipeline_parallel, schedules

REFUSE = "use Irecv/Isend (or Send/Recv) between two stages: this exercise builds the exchange itself"


def _check_schedule(fn, name, peak):
    for p in range(1, 9):
        for m in range(1, 17):
            sch = fn(p, m)
            try:
                schedules.validate(sch, p, m)
            except schedules.ScheduleError as e:
                raise AssertionError(f"{name}({p}, {m}): {e}")
            sim = schedules.simulate(sch, p, m)
            want = [peak(p, m, r) for r in range(p)]
            if sim.peak != want:
                r = next(r for r in range(p) if sim.peak[r] != want[r])
                raise AssertionError(f"{name}({p}, {m}): rank {r} holds {sim.peak[r]} micro-batches' activations at "
                                     f"once, {name} holds {want[r]} (check the warm-up: rank r runs p-r-1 forwards "
                                     "before its first backward)" if name == "one_f_one_b" else
                                     f"{name}({p}, {m}): rank {r} holds {sim.peak[r]} micro-batches' activations at "
                                     f"once, expected {want[r]}")
            f = schedules.formula("gpipe" if name == "gpipe" else "1f1b", p, m)
            if sim.bubble != f:
                raise AssertionError(f"{name}({p}, {m}): the simulated bubble is {sim.bubble} of the time, the "
                                     f"formula (p-1)/(m+p-1) gives {f}")


def check_gpipe(fn):
    _check_schedule(fn, "gpipe", lambda p, m, r: m)


def check_one_f_one_b(fn):
    _check_schedule(fn, "one_f_one_b", lambda p, m, r: min(p - r, m))


def check_exchange(fn, session=None):
    with own_session(session) as s:
        rank, n = s.rank(), s.size()
        comm = s.counting(REFUSE)
        g = np.random.default_rng(40 + rank)
        mine = g.standard_normal((2, 3, 4))
        before = mine.copy()
        partner = rank + 1 if rank % 2 == 0 else rank - 1
        if partner >= n:                                  # the odd one out: nothing to send or receive
            got, req = fn(comm, None, None)
            if got is not None or req is not None:
                raise AssertionError(f"rank {rank}: exchange(comm, None, None) returned {got!r}, {req!r}; "
                                     "expected (None, None)")
            return
        theirs = np.random.default_rng(40 + partner).standard_normal((2, 3, 4))
        got, req = fn(comm, (mine, partner, 7), ((2, 3, 4), np.float64, partner, 7))
        if comm.refused:
            raise AssertionError(comm.refused)
        if req is not None:
            s.wait_for(req.Test, f"the send's request to rank {partner}")
        if got is None or np.shape(got) != (2, 3, 4) or not np.array_equal(got, theirs):
            raise AssertionError(f"rank {rank}: received {None if got is None else np.shape(got)} from rank "
                                 f"{partner}, not the (2, 3, 4) array rank {partner} sent")
        if not np.array_equal(mine, before):
            raise AssertionError(f"rank {rank}: the array to send was changed")
        if comm.bytes_sent != mine.nbytes:
            raise AssertionError(f"rank {rank} sent {comm.bytes_sent} bytes; one (2, 3, 4) float64 array is "
                                 f"{mine.nbytes}")


EXERCISES = [
    Exercise("4.1", "gpipe", schedules.gpipe, check_gpipe),
    Exercise("4.2", "one_f_one_b", schedules.one_f_one_b, check_one_f_one_b),
    Exercise("4.3", "exchange", pipeline_parallel.exchange, check_exchange, 3),
]
