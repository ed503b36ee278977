"""Two all-reduces with lg N steps, for small messages: recursive doubling and Rabenseifner's.

    mpirun -n 5 python -m minidist.lessons.01_collectives    # all three beside MPI's own

The ring (collectives.py) pays 2(N-1) latencies; these two pay 2 lg N or fewer, which
wins when the message is small (Thakur, Rabenseifner and Gropp 2005, "Optimization of
collective communication operations in MPICH", sections 4.4-4.5; MPICH and Open MPI
switch between them by message size). Bytes each rank sends, M the array's bytes, P the
largest power of two <= N (docs/reference.md#collectives; minidist/plan/collectives.py):

    recursive doubling   lg P rounds: swap the whole array with the rank 1, 2, 4, ...
                         away, both add                          lg P x M
    Rabenseifner         reduce-scatter by recursive halving (lg P rounds: give away half
                         of what I still reduce, add the partner's piece of the half I
                         keep), then all-gather by recursive doubling (the same rounds
                         backwards, the pieces coming home)       2(P-1)/P x M

N not a power of two, say N = 6 = 4 + 2: first the 2(N-P) lowest ranks pair up, the even
one of each pair hands its array to the odd one and waits; the P remaining ranks run the
algorithm; at the end the odd ones hand the answer back (M more for them). MPICH does
the same. Its cost, 2 alpha + 2 M beta + M gamma, is why in the model the ring wins
large messages at N = 3, 5, 6 and 7.

Summation order. Both algorithms add pairs of neighbours first, then pairs of pairs:
x0 + x1 (and x2 + x3), then (x0 + x1) + (x2 + x3); a folded pair (x_2i + x_2i+1)
counts as one rank. So the two give the very same bits, and every rank gets them
(partners add the same two arrays, and IEEE addition is commutative). The ring adds
chunk c in the order x_c+1, x_c+2, ... around the circle: other roundings, so its
float results differ from these in the last bits (a few units in the last place of
the largest value), while integer sums, and floats whose sums are exact, agree bit
for bit with each other and with MPI's own.

Same conventions as the ring: new arrays, upper-case buffer methods only, counted under
"all_reduce" in minidist.comm.stats, checked first unless check=False, host or device
arrays (minidist/comm/staging.py).
"""
from minidist.comm import stats
from minidist.comm.checks import exchange, finish_avg, reduce_ufunc, refuse, wire
from minidist.comm.collectives import chunk_bounds, sendrecv
from minidist.comm.staging import asarray, namespace, staged
from minidist.comm.watchdog import waiting

TAG_DOUBLING, TAG_FOLD, TAG_HALVING, TAG_GATHERING = 30013, 30014, 30015, 30016


# ----------------------------------------------------------------------------- the fold

def _start(comm, x, name, op, check):
    """Check (or refuse); then x flat (a view: only ever read) and the result's buffer."""
    if check:
        exchange(comm, x, name, op=op)
    else:
        refuse(comm, x, name, op=op)
    xp = namespace(x)
    src = xp.asarray(x, order="C").reshape(-1)
    return src, xp.empty_like(src)


def _fold_in(comm, src, acc, combine):
    """Fold N down to P ranks. Returns (my virtual rank among the P, or None if I gave my
    array away; P; real(v) -> the real rank of virtual rank v; the array that holds my
    partial sum now: src, or acc once something was added)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    p2 = 1 << (size.bit_length() - 1)                     # largest power of two <= N
    extra = size - p2
    real = lambda v: 2 * v + 1 if v < extra else v + extra
    if rank < 2 * extra and rank % 2 == 0:
        _send(comm, src, rank + 1)                        # hand my array to my odd neighbour
        return None, p2, real, None
    if rank < 2 * extra:
        incoming = namespace(src).empty_like(src)
        _recv(comm, incoming, rank - 1)                   # take my even neighbour's array...
        combine(incoming, src, out=acc)                   # ...and add it, lower rank first
        return rank // 2, p2, real, acc
    return rank - extra, p2, real, src


def _fold_out(comm, acc, vrank):
    """Hand the answer back to the rank that folded into me (or wait for mine)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    extra = size - (1 << (size.bit_length() - 1))
    if vrank is None:
        _recv(comm, acc, rank + 1)
    elif rank < 2 * extra:
        _send(comm, acc, rank - 1)


def _finish(acc, x, op, size):
    return (finish_avg(acc, size) if op == "avg" else acc).reshape(x.shape)


# ----------------------------------------------------------------------------- recursive doubling

@staged
def recursive_doubling_all_reduce(comm, x, op="sum", check=True):
    """All-reduce in lg P rounds of whole-array swaps (any N: the extra ranks fold in first)."""
    x = asarray(x)
    with stats.counting("all_reduce"), waiting("recursive_doubling_all_reduce"):
        src, acc = _start(comm, x, "recursive_doubling_all_reduce", op, check)
        combine = reduce_ufunc(op, namespace(acc))
        vrank, p2, real, mine = _fold_in(comm, src, acc, combine)
        if vrank is not None:
            incoming = namespace(acc).empty_like(acc)
            distance, rounds = 1, 0
            while distance < p2:
                partner = real(vrank ^ distance)
                # swap whole arrays with the partner, then both add the same two arrays
                comm.Sendrecv(wire(mine), partner, TAG_DOUBLING, wire(incoming), partner, TAG_DOUBLING)
                combine(mine, incoming, out=acc)
                mine, distance, rounds = acc, distance * 2, rounds + 1
            # counted once for all rounds: a small message's time is mostly such overheads
            stats.add(sent=rounds * acc.nbytes, recv=rounds * acc.nbytes, messages=rounds)
            if mine is src:                               # one rank: nothing was added
                acc[:] = src
        _fold_out(comm, acc, vrank)
        return _finish(acc, x, op, comm.Get_size())


# ----------------------------------------------------------------------------- Rabenseifner

@staged
def rabenseifner_all_reduce(comm, x, op="sum", check=True):
    """All-reduce as a reduce-scatter by recursive halving, then an all-gather by recursive
    doubling, over the P = 2^floor(lg N) ranks left after the fold.

    The array is cut into P chunks (numpy.array_split's). A rank's window starts as all P
    chunks; each round at distance d = 1, 2, ..., P/2 it keeps half the window (the lower
    half if it is the lower partner) and gives the other half away, so after lg P rounds
    it holds one chunk reduced over all ranks. The all-gather replays the rounds backwards:
    send what I hold, receive the partner's half, until I hold all P chunks again.
    """
    x = asarray(x)
    with stats.counting("all_reduce"), waiting("rabenseifner_all_reduce"):
        src, acc = _start(comm, x, "rabenseifner_all_reduce", op, check)
        xp = namespace(acc)
        combine = reduce_ufunc(op, xp)
        vrank, p2, real, mine = _fold_in(comm, src, acc, combine)
        if vrank is not None and p2 == 1 and mine is src:
            acc[:] = src                                      # one rank: nothing to add
        if vrank is not None and p2 > 1:
            b = chunk_bounds(acc.size, p2)
            incoming = None
            lo, hi, distance, rounds = 0, p2, 1, []
            while distance < p2:
                partner, mid = real(vrank ^ distance), (lo + hi) // 2
                lower, upper = (lo, mid), (mid, hi)
                keep, give = (lower, upper) if vrank & distance == 0 else (upper, lower)
                kept, given = slice(b[keep[0]], b[keep[1]]), slice(b[give[0]], b[give[1]])
                # give away my piece of the other half, take the partner's piece of mine, add it
                if mine is src:     # nothing added yet: the partner's piece lands in its place
                    got = acc[kept]
                    sendrecv(comm, src[given], partner, got, partner, TAG_HALVING)
                    combine(got, src[kept], out=got)
                else:               # acc holds my partial sum: the partner's piece waits beside
                    if incoming is None:                  # the largest window still to come
                        incoming = xp.empty(kept.stop - kept.start, acc.dtype)
                    got = incoming[:kept.stop - kept.start]
                    sendrecv(comm, acc[given], partner, got, partner, TAG_HALVING)
                    combine(acc[kept], got, out=acc[kept])
                rounds.append((partner, keep, give))
                (lo, hi), distance, mine = keep, distance * 2, acc
            for partner, keep, give in reversed(rounds):
                # send the part I hold, reduced; the partner's lands in the half I gave away
                sendrecv(comm, acc[b[keep[0]]:b[keep[1]]], partner,
                         acc[b[give[0]]:b[give[1]]], partner, TAG_GATHERING)
        _fold_out(comm, acc, vrank)
        return _finish(acc, x, op, comm.Get_size())


def _send(comm, buf, dest):
    comm.Send(wire(buf), dest, TAG_FOLD)
    stats.add(sent=buf.nbytes, messages=1)


def _recv(comm, buf, source):
    comm.Recv(wire(buf), source, TAG_FOLD)
    stats.add(recv=buf.nbytes)
