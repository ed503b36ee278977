"""Context parallelism: the sequence cut across ranks, inside attention too (the layout, the
ring step and the attention core; the model around it: cp_model.py).

    mpirun -n 4 python -m minidist.lessons.13_context_parallel
    mpirun -n 4 python -m minidist.lessons.13_context_parallel --variant ulysses

Everything in a transformer layer but attention acts on each token alone, so a rank can
hold a slice of the sequence and run the layer on it. Attention mixes tokens: each query
needs every earlier key. Context parallelism (CP) keeps the sequence cut there as well
and moves keys and values, not activations, between the cp ranks of a group.

Layout (Megatron-LM's, for the causal mask): the sequence is cut into 2 cp chunks
(numpy.array_split: when 2 cp does not divide it, the first chunks are one token longer)
and rank r holds chunks r and 2cp-1-r. A contiguous split gives the last rank about
(2cp-1) times the first one's scores; the zigzag pairs an early chunk with a late one
(`load_balance=False` keeps the naive split, for comparison). Masks go by GLOBAL
positions (minidist/attention.py), so uneven and permuted chunks are exact.

Three variants behind one face, the attention core of each layer (`core(q, k, v,
dropout_p, rng, head0)`, minidist/model.py); bytes per rank per layer per step, forward +
backward, e = b kv hd itemsize, n = s/cp (exactly, uneven chunks too: plan/context.py):

- ring (ring attention: Liu, Zaharia & Abbeel 2023, arXiv 2310.01889; "pass-KV" is Yang
  et al. 2024's name, arXiv 2411.01783; Megatron-LM's default, `--cp-comm-type p2p`): my
  queries stay; cp-1 times the K, V block I hold goes to rank r+1 while I attend to it
  (Isend/Irecv posted first, MPI progressed between tiles: `overlap`), partial outputs
  merge by log-sum-exp. Backward: K, V go round again and each block's dK, dV accumulator
  travels with them, collecting every rank's part, home after cp-1 hops. 6 (cp-1) n e.
- ulysses (DeepSpeed-Ulysses; Jacobs et al. 2023, arXiv 2309.14509; Megatron's `a2a`): an
  all-to-all turns my tokens of all heads into all tokens of h/cp heads; blockwise
  attention on those; an all-to-all back. 4 all-to-alls forward (q, k, v, o), 4 backward:
  4 (h + kv) (cp-1)/cp b n hd itemsize. Heads must divide by cp.
- allgather (Megatron's `all_gather`): all-gather K and V, my queries attend to all of
  them: what Llama 3 describes (Grattafiori et al. 2024, arXiv 2407.21783, section 3.3.2,
  the 2cp load-balanced chunks, local queries). Its backward is not in the paper: here, as
  in Transformer Engine's all-gather CP, it gathers K, V again (nothing gathered is kept)
  and reduce-scatters dK, dV to their owners (comm.ring_reduce_scatter_v: each rank's
  piece its own length). 6 (cp-1) n e, in 3 collectives; small under GQA.

Memory per rank: activations of s/cp tokens (blockwise attention keeps no (s, s) array).
Within a layer the ring holds two K, V blocks (the one attended, the one arriving); its
backward also two dK, dV accumulators in flight (leaving, arriving) and the one being
computed; the all-gather holds all cp blocks (and their dK, dV in backward); Ulysses the
whole sequence for h/cp heads. Counters (ContextParallelAttention): bytes sent per
collective, seconds waited; in minidist.comm.stats the ring's messages count under
"ring_pass", the others under "all_to_all", "all_gather", "reduce_scatter".

On a device (this project's design, minidist/comm/staging.py): q, k, v and every
partial result stay device arrays. Ulysses and the all-gather call minidist.comm, which
stages device arrays through host buffers or hands them to a CUDA-aware MPI. The ring
posts its own Isend/Irecv (to overlap them with compute): on the staged path it sends a
host copy of my K, V (device to host, once per layer and pass), receives into host
buffers and copies each block it attends to over (host to device); the dK, dV
accumulators travel as host arrays and the arriving one is added to mine on the host,
as the comm layer's staged reductions add; on the direct path all of it stays on the
device. The positions of each chunk are host numbers (attention.Positions.arange).
"""
import time

import numpy as np
from mpi4py import MPI

from minidist.attention import (AttentionDropout, Positions, attention_partial,
                                attention_partial_backward, merge_partials)
from minidist.backend import on_device, to_device, to_numpy, xp
from minidist.comm import (all_to_all_v, chunk_bounds, ring_all_gather, ring_reduce_scatter_v, staging,
                           stats)
from minidist.comm.watchdog import waiting
from minidist.failfast import AgreedError
from minidist.plan.context import VARIANTS
from minidist.rng import dropout_rng_of
from minidist.tensor import Function

SEQ = 2                                   # q, k, v are (B, nh, T, hs): the sequence is axis 2
TAG_KV, TAG_GRAD = 12001, 12002           # the ring's K, V blocks and dK, dV accumulators


class CPError(AgreedError):
    """A context-parallel setting that cannot run (found alike on every rank)."""


def check_variant(variant):
    if variant not in VARIANTS:
        raise CPError(f"unknown context-parallel variant {variant!r}: choose one of "
                      f"{', '.join(VARIANTS)}")

# ----------------------------------------------------------------------------- the layout


def chunk_bounds_2cp(seq, cp):
    """Offsets [0, ..., seq] of the 2 cp chunks of numpy.array_split(range(seq), 2 cp)."""
    return chunk_bounds(seq, 2 * cp)


def rank_chunks(rank, cp, load_balance=True):
    """The chunk indices rank holds, in its order: [r, 2cp-1-r] (load balanced, Megatron's
    zigzag) or [2r, 2r+1] (naive: a contiguous slice). (Exercise 13.2.)"""
    return [rank, 2 * cp - 1 - rank] if load_balance else [2 * rank, 2 * rank + 1]


def rank_ranges(seq, cp, rank, load_balance=True):
    """[(lo, hi)] of global positions, one per chunk rank holds, in its order. cp = 1: one
    range (0, seq), one process's attention (its two chunks are adjacent, and cutting
    between them would only cut tiles: plan/context.py counts the one triangle)."""
    if cp == 1:
        return [(0, seq)]
    b = chunk_bounds_2cp(seq, cp)
    return [(b[c], b[c + 1]) for c in rank_chunks(rank, cp, load_balance)]


def rank_positions(seq, cp, rank, load_balance=True):
    """The global positions rank holds (an int array, in its chunk order)."""
    return np.concatenate([np.arange(lo, hi) for lo, hi in rank_ranges(seq, cp, rank, load_balance)])

# ----------------------------------------------------------------------------- one ring step


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    """One ring step, posted: each send array to rank+1, each recv array from rank-1.

    Returns the requests in this order, not waited for: [recv 0, send 0, recv 1, send 1,
    ...] (the ring backward takes the receives as [0::2], the sends as [1::2]); the caller
    computes meanwhile, then waits. (Exercise 13.3, whose stub states the same order.)"""
    n, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    requests = []
    for out, into in zip(send_arrays, recv_arrays):
        requests.append(comm.Irecv(into, source=left, tag=tag))   # what rank-1 passes me
        requests.append(comm.Isend(out, dest=right, tag=tag))     # what I pass to rank+1
    return requests


def ring_pass(comm, send_arrays, recv_arrays, tag):
    """ring_pass_start, counted in minidist.comm.stats under "ring_pass" (one call per step,
    one message per array)."""
    requests = ring_pass_start(comm, send_arrays, recv_arrays, tag)
    for i, (out, into) in enumerate(zip(send_arrays, recv_arrays)):
        stats.add("ring_pass", sent=out.nbytes, recv=into.nbytes, messages=1, calls=i == 0)
    return requests


def _wire(a):
    """What the ring hands MPI for the array `a`: on the direct path (CUDA-aware MPI) the
    device array itself, after the device's queued work (staging.hand_to_mpi); else a
    contiguous host copy (device to host, counted; a view on the CPU when contiguous)."""
    if staging.DIRECT and on_device(a):
        return staging.hand_to_mpi(xp.ascontiguousarray(a))
    return np.ascontiguousarray(to_numpy(a))


def _arrived(a):
    """A block the ring received, on the device to compute with (host to device, counted,
    on the staged path; itself on the direct path and on the CPU)."""
    return to_device(a)

# ----------------------------------------------------------------------------- the attention core


class ContextParallelAttention:
    """One layer's attention core across the cp ranks of `comm`.

    ranges[j]: [(lo, hi)] the position chunks cp rank j holds, in its order (set_layout).
    A query chunk meets a key chunk in one engine call (attention_partial), skipped when
    the causal mask hides it whole; its partials merge by log-sum-exp. Each variant is a
    pair of methods in STEPS: forward(q, k, v, drop) -> (o, saved), backward(saved, do,
    drop) -> (dq, dk, dv). Counters, reset by reset(): sent {collective: bytes} of this
    core's data (the collectives' checks apart), exposed_s (seconds spent waiting for
    messages: the communication compute did not hide), calls.
    """

    def __init__(self, comm, variant="ring", block=64, overlap=True, ranges=None):
        check_variant(variant)
        self.comm, self.variant, self.block, self.overlap = comm, variant, int(block), bool(overlap)
        self.cp, self.rank = comm.Get_size(), comm.Get_rank()
        self.ranges = ranges
        self.reset()

    def reset(self):
        self.sent, self.exposed_s, self.calls = {}, 0.0, 0

    def set_layout(self, ranges):
        self.ranges = ranges

    def __call__(self, q, k, v, dropout_p, rng, head0=0):
        nh = q.shape[1]
        if self.variant == "ulysses":
            if nh % self.cp:
                raise CPError(f"Ulysses needs the heads ({nh} here) to divide by cp ({self.cp})")
            head0 += self.rank * (nh // self.cp)              # my heads after the all-to-all
        drop = AttentionDropout(dropout_rng_of(rng), dropout_p, head0) if dropout_p > 0 else None
        return _CPAttention.apply(q, k, v, core=self, dropout=drop)

    # -- bookkeeping

    def _count(self, m):
        for name, row in m.items():
            if name != "check" and row["bytes_sent"]:
                self.sent[name] = self.sent.get(name, 0) + row["bytes_sent"]

    def _wait(self, requests):
        t0 = time.perf_counter()
        with waiting(f"context parallel ({self.variant}): the ring's messages"):
            MPI.Request.Waitall(requests)
        self.exposed_s += time.perf_counter() - t0

    def _blocking(self, fn, *args, **kw):
        """A blocking collective (allgather, Ulysses): all of its time is exposed."""
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.exposed_s += time.perf_counter() - t0
        return out

    def _pieces(self, rank):
        """[(slice of rank's rows, lo, hi)] of rank's chunks."""
        out, off = [], 0
        for lo, hi in self.ranges[rank]:
            out.append((slice(off, off + hi - lo), lo, hi))
            off += hi - lo
        return out

    def _tokens(self, rank):
        return sum(hi - lo for lo, hi in self.ranges[rank])

    def _block_like(self, a, owner):
        """A buffer for owner's block of an array like `a`, where MPI writes it: on the host
        (staged), on the device on the direct path."""
        shape = list(a.shape)
        shape[SEQ] = self._tokens(owner)
        return staging.hand_to_mpi((xp if staging.DIRECT else np).empty(shape, a.dtype))

    def _pass_kv(self, kv, owner):
        """Post the K, V block I hold to rank+1 and the receive of rank-1's, owner-1's block:
        (the buffers it arrives in, the requests). Not overlapped: waited for here."""
        nxt = tuple(self._block_like(a, (owner - 1) % self.cp) for a in kv)
        requests = ring_pass(self.comm, kv, nxt, TAG_KV)
        if not self.overlap:
            self._wait(requests)
        return nxt, requests

    # -- my queries against one rank's keys (ring and allgather)

    def _attend(self, q, k, v, owner, o, lse, drop, poll=None):
        for qs, qlo, qhi in self._pieces(self.rank):
            for ks, klo, khi in self._pieces(owner):
                if klo > qhi - 1:
                    continue                                  # every key after every query
                o2, l2 = attention_partial(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                           Positions.arange(qlo, qhi), Positions.arange(klo, khi),
                                           self.block, drop, poll)
                o[:, :, qs], lse[:, :, qs] = merge_partials(o[:, :, qs], lse[:, :, qs], o2, l2)

    def _attend_backward(self, q, k, v, owner, o, lse, do, dq, dk, dv, drop, poll=None):
        """Adds my queries' part of dq, and of owner's dk, dv (arrays of its rows, or views)."""
        for qs, qlo, qhi in self._pieces(self.rank):
            for ks, klo, khi in self._pieces(owner):
                if klo > qhi - 1:
                    continue
                g = attention_partial_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                               Positions.arange(qlo, qhi), Positions.arange(klo, khi),
                                               o[:, :, qs], lse[:, :, qs],
                                               do[:, :, qs], self.block, drop, poll)
                dq[:, :, qs] += g[0]
                dk[:, :, ks] += g[1]
                dv[:, :, ks] += g[2]

    # -- ring: forward and backward

    def ring_forward(self, q, k, v, drop):
        o = xp.zeros(q.shape, q.dtype)
        lse = xp.full(q.shape[:3], -xp.inf, dtype=q.dtype)
        n, r = self.cp, self.rank
        kv = (_wire(k), _wire(v)) if n > 1 else None
        for s in range(n):
            owner = (r - s) % n                               # whose K, V I hold now
            nxt, requests = self._pass_kv(kv, owner) if s < n - 1 else (None, [])
            poll = (lambda: MPI.Request.Testall(requests)) if requests and self.overlap else None
            here = (k, v) if s == 0 else (_arrived(kv[0]), _arrived(kv[1]))   # mine: on the device
            self._attend(q, *here, owner, o, lse, drop, poll)
            if requests:
                self._wait(requests)
                kv = nxt                                      # two blocks alive at most
        return o, (q, k, v, o, lse)

    def ring_backward(self, saved, do, drop):
        """Step s: owner r-s's K, V; my queries' part of its dK, dV is added to the
        accumulator rank r-1 sent me (started on rank owner+1) and passed on to r+1; the
        accumulator of my own block arrives at the last step. The send of the previous
        step is waited for before the next is posted: two accumulators in flight at most."""
        q, k, v, o, lse = saved
        n, r = self.cp, self.rank
        dq = xp.zeros(q.shape, q.dtype)
        dk, dv = xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)   # my block, my queries
        kv = (_wire(k), _wire(v)) if n > 1 else None
        arriving, into, leaving = [], None, []
        for s in range(n):
            owner = (r - s) % n
            nxt, requests = self._pass_kv(kv, owner) if s < n - 1 else (None, [])
            poll = ((lambda: MPI.Request.Testall(requests + leaving + arriving))
                    if self.overlap and (requests or leaving or arriving) else None)
            if s == 0:
                self._attend_backward(q, k, v, r, o, lse, do, dq, dk, dv, drop, poll)
            else:
                acc = (xp.zeros(kv[0].shape, k.dtype), xp.zeros(kv[1].shape, v.dtype))
                self._attend_backward(q, _arrived(kv[0]), _arrived(kv[1]), owner, o, lse, do, dq,
                                      *acc, drop, poll)
                acc = tuple(_wire(a) for a in acc)    # staged: summed on the host, as comm's are
                if into is not None:                          # this block's accumulator so far
                    self._wait(arriving)
                    for a, b in zip(acc, into):
                        a += b
                self._wait(leaving)                           # the last one I passed on has left
                into = tuple(self._block_like(a, (owner - 1) % n) for a in kv)
                reqs = ring_pass(self.comm, acc, into, TAG_GRAD)   # [recv, send, recv, send]
                arriving, leaving = reqs[0::2], reqs[1::2]
            if requests:
                self._wait(requests)
                kv = nxt
        if into is not None:                                  # everyone else's part of my dK, dV
            self._wait(arriving)
            dk, dv = dk + _arrived(into[0]), dv + _arrived(into[1])
        self._wait(leaving)
        return dq, dk, dv

    # -- allgather: forward and backward

    def _gathered(self, k, v):
        """Every rank's K and V, joined in rank order, and each rank's rows in them."""
        K, V = (self._blocking(ring_all_gather, self.comm, a, SEQ) for a in (k, v))   # a's kind back
        bounds = np.cumsum([0] + [self._tokens(j) for j in range(self.cp)])
        return K, V, [slice(bounds[j], bounds[j + 1]) for j in range(self.cp)]

    def allgather_forward(self, q, k, v, drop):
        o = xp.zeros(q.shape, q.dtype)
        lse = xp.full(q.shape[:3], -xp.inf, dtype=q.dtype)
        K, V, rows = self._gathered(k, v)
        for owner in range(self.cp):
            self._attend(q, K[:, :, rows[owner]], V[:, :, rows[owner]], owner, o, lse, drop)
        return o, (q, k, v, o, lse)

    def allgather_backward(self, saved, do, drop):
        q, k, v, o, lse = saved
        K, V, rows = self._gathered(k, v)                     # again: nothing gathered was kept
        dq, dK, dV = xp.zeros(q.shape, q.dtype), xp.zeros(K.shape, K.dtype), xp.zeros(V.shape, V.dtype)
        for j in range(self.cp):          # my queries' part of every rank's dK, dV, in one buffer
            self._attend_backward(q, K[:, :, rows[j]], V[:, :, rows[j]], j, o, lse, do, dq,
                                  dK[:, :, rows[j]], dV[:, :, rows[j]], drop)
        lengths = [self._tokens(j) for j in range(self.cp)]   # every rank's parts summed, each
        dk, dv = (self._blocking(ring_reduce_scatter_v, self.comm, g, lengths, axis=SEQ)
                  for g in (dK, dV))                                          # keeping its own
        return dq, dk, dv

    # -- ulysses: the all-to-alls and the attention on my heads

    def _seq_to_heads(self, x):
        """(B, nh, n_r, hs), my tokens of every head -> (B, nh/cp, T, hs), every token of
        my heads, in position order."""
        h = x.shape[1] // self.cp
        rows = x.transpose(2, 0, 1, 3)                        # (n_r, B, nh, hs)
        got = self._blocking(all_to_all_v, self.comm,         # rank j's heads go to j
                             [rows[:, :, j * h:(j + 1) * h] for j in range(self.cp)])
        whole = xp.empty((sum(len(g) for g in got),) + got[0].shape[1:], x.dtype)
        for j, g in enumerate(got):
            for sl, lo, hi in self._pieces(j):
                whole[lo:hi] = g[sl]                          # rank j's tokens, in their places
        return xp.ascontiguousarray(whole.transpose(1, 2, 0, 3))

    def _heads_to_seq(self, y):
        """The inverse: (B, nh/cp, T, hs) -> (B, nh, n_r, hs)."""
        rows = y.transpose(2, 0, 1, 3)                        # (T, B, nh/cp, hs)
        got = self._blocking(all_to_all_v, self.comm,         # rank j's tokens go to j
                             [xp.concatenate([rows[lo:hi] for lo, hi in self.ranges[j]])
                              for j in range(self.cp)])
        mine = xp.concatenate(got, axis=2)                    # heads in rank order
        return xp.ascontiguousarray(mine.transpose(1, 2, 0, 3))

    def ulysses_forward(self, q, k, v, drop):
        Q, K, V = (self._seq_to_heads(a) for a in (q, k, v))
        pos = Positions.arange(Q.shape[SEQ])
        O, L = attention_partial(Q, K, V, pos, pos, self.block, drop)
        return self._heads_to_seq(O), (Q, K, V, O, L)

    def ulysses_backward(self, saved, do, drop):
        Q, K, V, O, L = saved
        pos = Positions.arange(Q.shape[SEQ])
        dQ, dK, dV = attention_partial_backward(Q, K, V, pos, pos, O, L, self._seq_to_heads(do),
                                                self.block, drop)
        return tuple(self._heads_to_seq(g) for g in (dQ, dK, dV))


STEPS = {v: (getattr(ContextParallelAttention, f"{v}_forward"),
             getattr(ContextParallelAttention, f"{v}_backward")) for v in VARIANTS}


class _CPAttention(Function):
    """The attention of my queries over the whole sequence's keys, across the cp group.

    forward: the variant's exchange and partial attentions; saves q, k, v, o, lse of my
    tokens (Ulysses: of my heads' whole sequence). backward: the variant's backward;
    returns dq, and dk, dv of my tokens summed over every rank's queries.
    """

    @staticmethod
    def forward(ctx, q, k, v, core=None, dropout=None):
        ctx.core, ctx.dropout = core, dropout
        core.calls += 1
        with stats.measure() as m:
            o, saved = STEPS[core.variant][0](core, q, k, v, dropout)
        ctx.save_for_backward(*saved)
        core._count(m)
        return o

    @staticmethod
    def backward(ctx, grad):
        core = ctx.core
        with stats.measure() as m:
            out = STEPS[core.variant][1](core, ctx.saved, grad, ctx.dropout)
        core._count(m)
        return out
