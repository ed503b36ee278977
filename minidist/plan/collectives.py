"""Collectives' formulas: the elements each rank sends (exact, for the uneven chunks that
numpy.array_split makes) and the alpha-beta time of each all-reduce algorithm.

Bytes (docs/reference.md#collectives): a ring all-reduce of M bytes over N ranks sends
2(N-1)/N M per rank; reduce-scatter and all-gather (N-1)/N M each. The functions below
count chunk by chunk, so they are exact when N does not divide the message.

Time, the alpha-beta-gamma model (alpha seconds per message, beta seconds per byte sent,
gamma seconds per byte reduced; Thakur, Rabenseifner and Gropp 2005, "Optimization of
collective communication operations in MPICH", IJHPCA 19(1), sections 4.4-4.5, and
MPICH's source comments). P = 2^floor(lg N), the largest power of two <= N:
  ring all-reduce          2(N-1) alpha + 2(N-1)/N M beta + (N-1)/N M gamma
  ring reduce-scatter      (N-1) alpha + (N-1)/N M beta      (all-gather the same)
  recursive doubling       lg P (alpha + M beta + M gamma)
  Rabenseifner             2 lg P alpha + 2(P-1)/P M beta + (P-1)/P M gamma
and, when N is not a power of two, both of the last two first fold N - P ranks into
their neighbours and hand them the answer at the end: 2 alpha + 2 M beta + M gamma more
(the paper's non-power-of-two step, as MPICH does it).

The model's choice (`cheapest`) and where it changes (`crossovers`) are what
all_reduce(algorithm="auto") uses (minidist/comm/tuning.py).
"""


from minidist.plan.rules import chunk_bounds  # noqa: F401  (the engine's cut, stated once there)


def chunk_len(n, size, c):
    """Length of chunk c of chunk_bounds(n, size), without listing the bounds (a search
    counts rings of thousands of ranks many times)."""
    q, r = divmod(n, size)
    return q + (c < r)


def ring_all_reduce_sent(n, size, rank):
    """Elements rank sends in a ring all-reduce of n: every chunk but its own in the
    reduce-scatter, every chunk but its right neighbour's in the all-gather."""
    if size == 1:
        return 0
    mine, right = chunk_len(n, size, rank), chunk_len(n, size, (rank + 1) % size)
    return (n - mine) + (n - right)


def ring_reduce_scatter_sent(rows, row, size, rank):
    """Elements sent to reduce-scatter `rows` rows of `row` elements: all but my chunk."""
    return (rows - chunk_len(rows, size, rank)) * row


def ring_all_gather_sent(rows, row, size, rank):
    """Elements sent to all-gather pieces of `rows` rows in all: all but my right neighbour's."""
    return (rows - chunk_len(rows, size, (rank + 1) % size)) * row


def ring_all_reduce_bytes(nbytes, size):
    """Bytes each rank sends in a ring all-reduce of nbytes that size divides: 2(N-1)/N M."""
    return 2 * (size - 1) * nbytes // size


def ring_all_reduce_time(nbytes, size, alpha, beta, gamma=0.0):
    """Seconds of a ring all-reduce of nbytes over size ranks:
    2(N-1) alpha + 2(N-1)/N M beta + (N-1)/N M gamma."""
    if size == 1:
        return 0.0
    return 2 * (size - 1) * alpha + (size - 1) / size * nbytes * (2 * beta + gamma)


def ring_half_time(nbytes, size, alpha, beta):
    """Seconds of a ring reduce-scatter or all-gather of nbytes (the whole vector) over size
    ranks: (N-1) alpha + (N-1)/N M beta."""
    if size == 1:
        return 0.0
    return (size - 1) * alpha + (size - 1) / size * nbytes * beta


# ----------------------------------------------------------------------------- log-step all-reduces

def power_of_two_below(size):
    """P = 2^floor(lg N): the ranks that stay in the game after the extra ones fold in."""
    return 1 << (size.bit_length() - 1)


def folded(size, rank):
    """'gives' for rank 2i < 2(N-P) (it hands its array to rank 2i+1 and waits),
    'takes' for rank 2i+1 (it adds that array in, and hands the answer back), else None."""
    extra = size - power_of_two_below(size)
    if rank >= 2 * extra:
        return None
    return "gives" if rank % 2 == 0 else "takes"


def recursive_doubling_all_reduce_sent(n, size, rank):
    """Elements rank sends in a recursive-doubling all-reduce of n: the whole vector once
    per round, lg P rounds; a folded rank sends it once, its partner once more."""
    role = folded(size, rank)
    if role == "gives":
        return n
    rounds = power_of_two_below(size).bit_length() - 1
    return n * (rounds + (role == "takes"))


def halving_windows(vrank, p2):
    """The chunk windows of Rabenseifner's reduce-scatter for virtual rank vrank of p2:
    a list, one entry per round at distance 1, 2, ..., p2/2, of (partner, (lo, hi) kept,
    (lo, hi) sent), in chunks. The lower of two partners keeps the lower half."""
    lo, hi, d, out = 0, p2, 1, []
    while d < p2:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if vrank & d == 0 else ((mid, hi), (lo, mid))
        out.append((vrank ^ d, keep, give))
        lo, hi = keep
        d *= 2
    return out


def rabenseifner_all_reduce_sent(n, size, rank):
    """Elements rank sends in Rabenseifner's all-reduce of n (the chunks of
    numpy.array_split(n, P)): in the reduce-scatter the half it gives away each round,
    in the all-gather everything it holds each round; a folded pair as in recursive
    doubling. When P divides n: 2(P-1)/P n, plus n for the rank that hands the answer back."""
    role = folded(size, rank)
    if role == "gives":
        return n
    p2, extra = power_of_two_below(size), size - power_of_two_below(size)
    if p2 == 1:
        return 0
    b = chunk_bounds(n, p2)
    vrank = rank // 2 if rank < 2 * extra else rank - extra
    windows = halving_windows(vrank, p2)
    given = sum(b[g[1]] - b[g[0]] for _, _, g in windows)
    held = sum(b[k[1]] - b[k[0]] for _, k, _ in windows)    # what I hold before each gather round
    return given + held + n * (role == "takes")


def recursive_doubling_time(nbytes, size, alpha, beta, gamma=0.0):
    """lg P (alpha + M beta + M gamma), plus 2 alpha + 2 M beta + M gamma when N != P."""
    p2 = power_of_two_below(size)
    t = (p2.bit_length() - 1) * (alpha + nbytes * (beta + gamma))
    return t + _fold_time(nbytes, size, alpha, beta, gamma)


def rabenseifner_time(nbytes, size, alpha, beta, gamma=0.0):
    """2 lg P alpha + 2(P-1)/P M beta + (P-1)/P M gamma, plus the fold when N != P."""
    p2 = power_of_two_below(size)
    t = 2 * (p2.bit_length() - 1) * alpha + (p2 - 1) / p2 * nbytes * (2 * beta + gamma)
    return t + _fold_time(nbytes, size, alpha, beta, gamma)


def alpha_beta_terms(name, size):
    """(messages, bytes sent per byte of M, bytes added per byte of M) of an all-reduce on
    the power-of-two part P of size ranks, the fold left out (`_fold_time`):
    ring 2(N-1), 2(N-1)/N, (N-1)/N; Rabenseifner 2 lg P, 2(P-1)/P, (P-1)/P;
    recursive doubling lg P, lg P, lg P. The time is alpha, beta and gamma times these."""
    p2 = power_of_two_below(size)
    lg = p2.bit_length() - 1
    if name == "ring":
        return 2 * (size - 1), 2 * (size - 1) / size, (size - 1) / size
    if name == "rabenseifner":
        return 2 * lg, 2 * (p2 - 1) / p2, (p2 - 1) / p2
    if name == "recursive_doubling":
        return lg, lg, lg
    raise ValueError(f"unknown all-reduce {name!r}: one of {', '.join(ALL_REDUCE_TIMES)}")


def _fold_time(nbytes, size, alpha, beta, gamma):
    if size == power_of_two_below(size):
        return 0.0
    return 2 * alpha + nbytes * (2 * beta + gamma)


# ----------------------------------------------------------------------------- the model's choice

# The algorithms all_reduce(algorithm="auto") chooses from, in the order that wins a tie
# (this project's own rule: the ring first, being the default everywhere else).
ALL_REDUCE_TIMES = {"ring": ring_all_reduce_time, "rabenseifner": rabenseifner_time,
                    "recursive_doubling": recursive_doubling_time}


def all_reduce_times(nbytes, size, alpha, beta, gamma=0.0):
    """{algorithm: the model's seconds} for an all-reduce of nbytes over size ranks."""
    return {k: f(nbytes, size, alpha, beta, gamma) for k, f in ALL_REDUCE_TIMES.items()}


def cheapest(nbytes, size, alpha, beta, gamma=0.0):
    """The algorithm the model finds fastest (ties go to the first in ALL_REDUCE_TIMES)."""
    times = all_reduce_times(nbytes, size, alpha, beta, gamma)
    return min(times, key=times.get)


def _line(name, size, alpha, beta, gamma):
    """(seconds at 0 bytes, seconds per byte) of an algorithm's time: it is a line in M."""
    f = ALL_REDUCE_TIMES[name]
    at0 = f(0, size, alpha, beta, gamma)
    return at0, f(1.0, size, alpha, beta, gamma) - at0


def crossover(a, b, size, alpha, beta, gamma=0.0):
    """The size M in bytes where algorithms a and b take equal time, when a is the faster
    below it and b above it; None when that never happens (the lines do not cross at
    M > 0, or cross the other way)."""
    (a0, a1), (b0, b1) = _line(a, size, alpha, beta, gamma), _line(b, size, alpha, beta, gamma)
    # slopes equal but for rounding (Rabenseifner and the ring at N = 2^k) do not cross
    if not (a0 < b0 and a1 - b1 > 1e-9 * max(abs(a1), abs(b1))):
        return None
    return (b0 - a0) / (a1 - b1)


def crossovers(size, alpha, beta, gamma=0.0):
    """[(M, faster below, faster above)]: where the model's cheapest algorithm changes, by M."""
    out, m, best = [], 0.0, cheapest(0, size, alpha, beta, gamma)
    while True:
        nxt = [(crossover(best, o, size, alpha, beta, gamma), o)
               for o in ALL_REDUCE_TIMES if o != best]
        nxt = [(x, o) for x, o in nxt if x is not None and x > m]
        if not nxt:
            return out
        first = min(x for x, _ in nxt)
        # lines that meet the cheapest one at the same M (N = 2: ring and Rabenseifner are
        # the same line): the first in ALL_REDUCE_TIMES wins, as in cheapest()
        m, other = next((x, o) for o in ALL_REDUCE_TIMES for x, o2 in nxt
                        if o2 == o and x <= first * (1 + 1e-9))
        out.append((m, best, other))
        best = other


# ------------------------------------------------------------------------- what lesson 01 prints

def formulas(n, m):
    """Bytes the busiest rank sends in one call of each of lesson 01's collectives (m bytes,
    n ranks, m divisible by n and by P; docs/reference.md#collectives)."""
    m = int(m)
    p2 = power_of_two_below(n)
    lg = p2.bit_length() - 1
    return {
        "all_reduce (ring)": ring_all_reduce_bytes(m, n),
        "all_reduce (naive)": (n - 1) * m,                       # rank 0 broadcasts to n-1 ranks
        "all_reduce (recursive doubling)": (lg + (n != p2)) * m,
        "all_reduce (rabenseifner)": 2 * (p2 - 1) * m // p2 + (n != p2) * m,
        "reduce_scatter (ring)": (n - 1) * m // n,
        "all_gather (ring)": (n - 1) * m // n,
        "broadcast (linear)": (n - 1) * m,
        "reduce (linear)": m if n > 1 else 0,
        "all_to_all (pairwise)": (n - 1) * m // n,
        "all_reduce (MPI's own)": None,                          # MPI does not tell
    }


# nccl-tests' bus-bandwidth factors (NVIDIA/nccl-tests doc/PERFORMANCE.md): busbw = algbw x factor
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
