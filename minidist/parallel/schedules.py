"""Pipeline schedules as plain data: who computes what, in which order.

    python -c "from minidist.parallel import schedules as s; print(s.picture(s.one_f_one_b(4, 8)))"

A schedule for p ranks is a list of p lists; rank r's list is the ordered compute
actions it runs, each a tuple (op, micro_batch, chunk):

    "F"  forward of that micro-batch through the chunk's layers
    "B"  backward: input and weight gradients together, or (in a split schedule, where
         "W" appears) the input gradient only
    "W"  the weight gradient (split schedules only: zero bubble)

chunk is 0 unless interleaved: chunk c of rank r holds virtual stage c*p + r of the
p*v stages the model is cut into. Sends and receives are implied: an F's output goes
to the next virtual stage, a B's input gradient to the previous one.

One schedule, three uses: `picture` draws it (ranks as rows, time as columns, as the
Megatron-LM and zero-bubble papers draw theirs), `simulate` runs it in logical time
(the bubble fraction and peak live activations per rank; messages take no time unless
given a latency), and minidist/parallel/pipeline_parallel.py executes it in a real
training step.
`validate` is the referee for all three: it refuses a schedule that could not run.

The bubble fractions the literature gives, which `simulate` must reproduce exactly
(tests/test_schedules.py), are minidist/plan/pipeline.py's bubble_fraction: naive
(p-1)/p; GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B with v chunks (p-1)/(v m + p-1);
ZB-H1 (p-1)(f+B-W) of idle time per rank (Qi et al. 2024).
"""
from fractions import Fraction

OPS = ("F", "B", "W")
NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


class ScheduleError(ValueError):
    """A schedule that cannot run: an action missing or twice, a backward before its
    forward, or an order in which some rank waits for ever."""


# ----------------------------------------------------------------------------- the schedules

def naive(p, m):
    """One micro-batch at a time through every stage and back: no two stages ever busy at
    once. What a first model-parallel loop does; the bubble is (p-1)/p."""
    return [[a for i in range(m) for a in (("F", i, 0), ("B", i, 0))] for _ in range(p)]


def gpipe(p, m):
    """GPipe (Huang et al. 2018): all m forwards, then all m backwards. Every micro-batch's
    activations are alive at the turn: m of them on every rank."""
    return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(p)]


def one_f_one_b(p, m):
    """1F1B: PipeDream's schedule (Narayanan et al., SOSP 2019), flushed as PipeDream-Flush
    (the PipeDream-2BW paper, Narayanan et al., ICML 2021), as Megatron-LM runs it
    (Narayanan et al., SC 2021, section 2.2).

    Rank r warms up with p-r-1 forwards (what is in flight below it), then alternates one
    forward and one backward, then drains the last backwards. A micro-batch's activations
    are freed by its backward, so at most p-r are alive on rank r (GPipe: m).
    """
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):                  # steady state: one forward, one backward
            acts += [("F", warm + i, 0), ("B", i, 0)]
        acts += [("B", i, 0) for i in range(m - warm, m)]   # cool-down
        out.append(acts)
    return out


def interleaved_1f1b(p, m, v, warmup_factor=2):
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): v chunks per rank.

    Forwards go in groups of p micro-batches: chunk 0 for micro-batches 0..p-1, then
    chunk 1 for the same ones, ..., then chunk 0 for the next p; backwards in the same
    groups from the last chunk down. Rank r warms up with 2(p-r-1) + (v-1)p forwards (at
    most m v, all of them), then alternates one forward and one backward, then drains.
    m must be a multiple of p. Megatron-LM's and PyTorch's interleaved schedules warm up
    with the same count, capped the same way.

    Why 2(p-r-1) and not p-r-1: with p-r-1 the schedule is just as valid, just as fast
    while messages take no time, and holds p-r-1 fewer micro-batches on rank r (p = 4,
    m = 8, v = 2: peaks 8 7 6 5 against 11 9 7 5). But it has almost no slack: in its
    steady state most forwards start the moment their inputs arrive, so a message that
    takes time is waited for again at every step. The p-r-1 more forwards put that
    many more micro-batches in flight ahead of rank r's backwards, and the steady state
    gets slack: a message latency lam of up to one chunk's forward lengthens the step by
    exactly 2(pv-1) lam, the first micro-batch's way down through the pv-1 boundaries
    and the last one's way back up (tests/test_schedules.py); without the factor, by
    more, growing with m (p = 4, m = 8, v = 2, lam a quarter of a chunk's forward: bubble
    0.207 with it, 0.256 without). simulate(..., latency=) shows it; lesson 04's
    --latency draws both. warmup_factor=1 builds the variant without the factor.
    """
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ScheduleError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the stages ({p})")
    n = m * v                                      # forwards (and backwards) per rank

    def fwd(k):                                    # k-th forward of a rank
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = []
    for r in range(p):
        warm = min(warmup_factor * (p - r - 1) + (v - 1) * p, n)
        acts = [fwd(k) for k in range(warm)]
        for k in range(n - warm):
            acts += [fwd(warm + k), bwd(k)]
        acts += [bwd(k) for k in range(n - warm, n)]
        out.append(acts)
    return out


def zero_bubble_h1(p, m):
    """ZB-H1 (Qi, Wan, Huang, Lin 2024, arXiv 2401.10241): the backward split into B (input gradient, which the
    previous stage waits for) and W (weight gradient, which nobody waits for).

    Built by running the ranks in unit time steps (F = B = W = 1), each free rank taking,
    in this order: the next F, if its input has arrived, fewer than p-r micro-batches
    wait for their B (1F1B's warm-up) and fewer than p hold activations (they live until
    W: 1F1B's peak memory); else the oldest B whose gradient has arrived; else the oldest
    pending W. A W thus fills what would be a bubble. With m >= p the total time is
    m(f+b) + (p-1)(f+B-W), the paper's figure, for p <= 8 and m <= 16 (tests/test_schedules.py).
    """
    done = {}                                      # (rank, op, mb) -> time it ends
    out = [[] for _ in range(p)]
    nxt_f, nxt_b, n_w, pending_w = [0] * p, [0] * p, [0] * p, [[] for _ in range(p)]
    free, t = [0] * p, 0
    while any(len(a) < 3 * m for a in out):
        for r in range(p):
            if free[r] > t:
                continue
            ready = lambda key: key in done and done[key] <= t          # noqa: E731
            i, j = nxt_b[r], nxt_f[r]
            if (j < m and j - i < p - r and j - n_w[r] < p
                    and (r == 0 or ready((r - 1, "F", j)))):
                act, nxt_f[r] = ("F", j, 0), j + 1
            elif i < j and (ready((r + 1, "B", i)) if r < p - 1 else ready((r, "F", i))):
                act, nxt_b[r] = ("B", i, 0), i + 1
                pending_w[r].append(i)
            elif pending_w[r]:
                act, n_w[r] = ("W", pending_w[r].pop(0), 0), n_w[r] + 1
            else:
                continue                           # idle: the bubble
            out[r].append(act)
            done[(r, act[0], act[1])] = t + 1
            free[r] = t + 1
        t += 1
    return out


def build(name, p, m, v=1):
    """The schedule called `name` (one of NAMES); v only for interleaved."""
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    table = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1}
    if name not in table:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(NAMES)}")
    return table[name](p, m)


# ----------------------------------------------------------------------------- dependencies

def stage_of(r, c, p):
    """Virtual stage of rank r's chunk c."""
    return c * p + r


def place(s, p):
    """(rank, chunk) holding virtual stage s."""
    return s % p, s // p


def depends_on(action, r, p, v):
    """The action on another rank this one waits for (its message), or None.

    F waits for the previous virtual stage's F (its activations); B waits for the next
    virtual stage's B (the gradient of its output). The last stage's B and every W wait
    only for actions of their own rank, which the rank's order already places before.
    """
    op, mb, c = action
    s = stage_of(r, c, p)
    if op == "F" and s > 0:
        rank, chunk = place(s - 1, p)
        return rank, ("F", mb, chunk)
    if op == "B" and s < p * v - 1:
        rank, chunk = place(s + 1, p)
        return rank, ("B", mb, chunk)
    return None


def fmt(action, v=1):
    """("B", 3, 1) -> "B3" (or "B3.1" when interleaved: micro-batch 3, chunk 1)."""
    op, mb, c = action
    return f"{op}{mb}" + (f".{c}" if v > 1 else "")


def validate(schedule, p, m, v=1):
    """Raise ScheduleError unless the schedule can run; return True otherwise.

    Checks, in the order a student would want to read them: p lists of (op, mb, chunk)
    tuples; every F and B of every (micro-batch, chunk) exactly once on its rank, and W
    for all or none (a split schedule); on one rank, B after its F and W after its B;
    and that the ranks, each running its list in order and waiting only for the messages
    its actions need (depends_on), all reach the end: the sends and receives the
    schedule implies cannot deadlock.
    """
    if len(schedule) != p:
        raise ScheduleError(f"the schedule has {len(schedule)} rank lists, the pipeline {p} ranks")
    split = any(a[0] == "W" for acts in schedule for a in acts if isinstance(a, tuple) and a)
    for r, acts in enumerate(schedule):
        seen = {}
        for k, a in enumerate(acts):
            if not (isinstance(a, tuple) and len(a) == 3 and a[0] in OPS and
                    all(isinstance(x, int) for x in a[1:]) and 0 <= a[1] < m and 0 <= a[2] < v):
                raise ScheduleError(f"rank {r}, position {k}: {a!r} is not an action (op in F/B/W, "
                                    f"micro-batch in 0..{m - 1}, chunk in 0..{v - 1})")
            if a in seen:
                raise ScheduleError(f"rank {r} lists {fmt(a, v)} twice (positions {seen[a]} and {k})")
            seen[a] = k
        want = [(op, i, c) for c in range(v) for i in range(m) for op in (OPS if split else "FB")]
        missing = [fmt(a, v) for a in want if a not in seen]
        if missing:
            raise ScheduleError(f"rank {r} never runs {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else ""))
        for (op, i, c), k in seen.items():
            before = {"B": "F", "W": "B"}.get(op)
            if before and seen[(before, i, c)] > k:
                raise ScheduleError(f"rank {r} runs {fmt((op, i, c), v)} before {fmt((before, i, c), v)} "
                                    f"(positions {k} and {seen[(before, i, c)]}): "
                                    + ("a backward needs its forward's activations" if op == "B"
                                       else "a weight gradient needs the backward's output gradient"))
    progress(schedule, p, v)
    return True


def progress(schedule, p, v=1):
    """Run the lists in order, each action once what it waits for has run; the order in
    which actions became possible. ScheduleError naming the waits when the ranks stick."""
    pos, done, order = [0] * p, set(), []
    while True:
        moved = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                dep = depends_on(a, r, p, v)
                if dep is not None and dep not in done:
                    break
                done.add((r, a))
                order.append((r, a))
                pos[r] += 1
                moved = True
        if not moved:
            break
    stuck = [r for r in range(p) if pos[r] < len(schedule[r])]
    if stuck:
        waits = []
        for r in stuck:
            a = schedule[r][pos[r]]
            dr, da = depends_on(a, r, p, v)
            waits.append(f"rank {r} waits at {fmt(a, v)} for rank {dr}'s {fmt(da, v)}")
        raise ScheduleError("deadlock: " + "; ".join(waits) + " (each wait is on an action that comes "
                            "after another wait in its rank's list)")
    return order


# ----------------------------------------------------------------------------- simulation

class Simulation:
    """What `simulate` found: times of every action, bubble fraction, peak live activations."""

    def __init__(self, start, end, busy, total, peak):
        self.start, self.end, self.busy, self.total, self.peak = start, end, busy, total, peak

    @property
    def bubble(self):
        """Idle fraction of the total time p x T, as an exact Fraction."""
        return 1 - sum(self.busy) / (len(self.busy) * self.total)


def costs_of(schedule, v=1, costs=(1, 2, 1)):
    """{op: cost} of one action: costs (f, b, w) are a whole stage's; a chunk costs 1/v of them.
    b is the whole backward: in a split schedule B takes b - w and W takes w."""
    f, b, w = (Fraction(c) for c in costs)
    split = any(a[0] == "W" for acts in schedule for a in acts)
    return {"F": f / v, "B": (b - w if split else b) / v, "W": w / v}


def simulate(schedule, p, m, v=1, costs=(1, 2, 1), latency=0):
    """Run a valid schedule in logical time: each action starts when its rank is free and
    its message has arrived, and lasts its cost.

    latency: the time a message between two ranks takes, in the units of costs (a
    chunk's forward takes f/v): an action that waits for another rank's starts no
    earlier than that action's end plus latency. 0, the default, is the formulas'
    assumption: communication is free.

    Peak live activations per rank: (micro-batch, chunk) pairs whose forward has run and
    whose last backward action (B, or W in a split schedule) has not.
    """
    validate(schedule, p, m, v)
    cost = costs_of(schedule, v, costs)
    latency = Fraction(latency)
    if latency < 0:
        raise ValueError(f"a message cannot take negative time, got latency {latency}")
    split = any(a[0] == "W" for acts in schedule for a in acts)
    end, start = {}, {}
    free = [Fraction(0)] * p
    for r, a in progress(schedule, p, v):        # an order in which every wait is already met
        dep = depends_on(a, r, p, v)
        arrives = 0 if dep is None else end[dep] + (latency if dep[0] != r else 0)
        t0 = max(free[r], arrives)
        start[(r, a)], end[(r, a)] = t0, t0 + cost[a[0]]
        free[r] = end[(r, a)]
    total = max(free)
    busy = [sum(cost[a[0]] for a in acts) for acts in schedule]
    peak = []
    for r, acts in enumerate(schedule):
        live = best = 0
        for a in acts:
            live += a[0] == "F"
            live -= a[0] == ("W" if split else "B")
            best = max(best, live)
        peak.append(best)
    return Simulation(start, end, busy, total, peak)


def picture(schedule, v=1, costs=(1, 2, 1), latency=0, width=None):
    """The schedule as text: one row per rank, one column per unit of logical time.

    Every action is drawn as cost x one cell (a chunk as wide as a whole stage, so
    the picture stays readable when interleaved); '.' is idle time: the bubble.
    latency: a message's time, in the units of costs as simulate's (a cell is one chunk's
    forward, f/v); an action is drawn from the cell nearest to its start, so latencies
    of a fraction of a cell show where they add up.
    width: wrap the rows into blocks of at most that many characters, each headed by
    the time its first column starts at (None: one line per rank, however long).
    """
    p = len(schedule)
    m = 1 + max(a[1] for acts in schedule for a in acts)
    sim = simulate(schedule, p, m, v, costs=tuple(Fraction(c) * v for c in costs), latency=Fraction(latency) * v) \
        if v > 1 else simulate(schedule, p, m, v, costs=costs, latency=latency)
    w = max(len(fmt(a, v)) for acts in schedule for a in acts)

    def cell(t):                                   # the nearest whole cell (halves up)
        return int(t + Fraction(1, 2)) if latency else int(t)

    spans = {(r, a): (cell(sim.start[(r, a)]), cell(sim.start[(r, a)]) + int(sim.end[(r, a)] - sim.start[(r, a)]))
             for r in range(p) for a in schedule[r]}
    cells = max(t1 for _, t1 in spans.values())
    rows = []
    for r in range(p):
        line = ["." * w] * cells
        for a in schedule[r]:
            t0, t1 = spans[(r, a)]
            line[t0] = fmt(a, v).ljust(w)
            for t in range(t0 + 1, t1):
                line[t] = "-" * w
        rows.append(line)
    head = [f"rank {r}  " for r in range(p)]
    per = cells if width is None else max(1, (width - len(head[-1]) + 1) // (w + 1))
    if per >= cells:
        return "\n".join(h + " ".join(line) for h, line in zip(head, rows))
    blocks = []
    for c0 in range(0, cells, per):
        blocks.append("\n".join([" " * len(head[-1]) + f"t = {c0}"]
                                + [h + " ".join(line[c0:c0 + per]) for h, line in zip(head, rows)]))
    return "\n\n".join(blocks)
