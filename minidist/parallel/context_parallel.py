"""Context parallelism: the sequence cut across ranks, inside attention too.

    mpirun -n 4 python -m minidist.lessons.13_context_parallel
    mpirun -n 4 python -m minidist.lessons.13_context_parallel --variant ulysses

Everything in a transformer layer but attention acts on each token alone, so a rank can
hold a slice of the sequence and run the layer on it (sequence parallelism already does
that between the tensor-parallel regions). Attention mixes tokens: each query needs every
earlier key. Context parallelism (CP) keeps the sequence cut there as well and moves keys
and values, not activations, between the cp ranks of a group.

Layout (Megatron-LM's, for the causal mask): the sequence is cut into 2 cp chunks
(numpy.array_split: when 2 cp does not divide it, the first chunks are one token longer)
and rank r holds chunks r and 2cp-1-r. Under the causal mask the work of a query grows
with its position; a contiguous split would give the last rank (2cp-1) times the first
one's scores, the zigzag pairs an early chunk with a late one and every rank gets the
same work (`load_balance=False` keeps the naive split, for comparison). Masks go by
GLOBAL positions (minidist/attention.py), so uneven and permuted chunks are exact.

Three variants behind one face, the attention core of each layer (`core(q, k, v,
dropout_p, rng, head0)`, minidist/model.py); n_r = my tokens, e = b kv hd itemsize the
bytes of one token's K (or V); bytes per rank per layer per step, forward + backward
(exactly: minidist/plan/context.py's cp_sent; with equal chunks n = s/cp):

- ring (pass-KV; Liu, Zaharia & Abbeel 2023, arXiv 2310.01889, as Megatron-LM's CP and
  its Transformer Engine "p2p" do it): my queries stay; cp-1 times the K, V block I hold
  goes to rank r+1 while I attend to it (Isend/Irecv posted first, MPI progressed between
  tiles: `overlap`), partial outputs merge by log-sum-exp. Backward: K, V go round again
  and each block's dK, dV accumulator travels with them, collecting every rank's
  contribution and arriving home after cp-1 hops. 6 (cp-1) b n kv hd.
- ulysses (DeepSpeed-Ulysses; Jacobs et al. 2023, arXiv 2309.14509): an all-to-all turns
  my tokens of all heads into all tokens of h/cp heads; plain blockwise attention on
  those; an all-to-all back. 4 all-to-alls forward (q, k, v, o), 4 backward:
  4 (h + kv) (cp-1)/cp b n hd. Heads must divide by cp.
- allgather (Llama 3, Dubey et al. 2024, arXiv 2407.21783, section 3.3.2): all-gather K
  and V, my queries attend to all of them; backward gathers them again (nothing gathered
  is kept) and reduce-scatters dK, dV to their owners, each rank's piece its own length.
  6 (cp-1) b n kv hd, like the ring, in 3 collectives; small under GQA (Llama 3's 8 KV heads).

Memory per rank: activations of s/cp tokens (blockwise attention keeps no (s, s) array:
q, k, v, o and the log-sum-exp of my tokens); the ring and the all-gather hold one or
all K, V blocks during a layer, Ulysses the whole sequence for h/cp heads.

Training (ContextParallelGPT): each rank of a cp group takes the same whole rows, keeps
its positions, embeds them with their global positions, draws every dropout mask as one
process would (the whole mask, sliced at my positions; the attention's by position). The
loss is the sum over my tokens / all tokens, summed over the group in forward (its value:
the mean over all tokens); each rank's weight gradient is then its tokens' share, so the
backward is scaled by cp and the gradients are averaged over grid.dp_cp_comm (dp x cp
ranks): exactly the single-process gradient. Megatron-LM multiplies the loss by the CP
size and folds CP into the data-parallel gradient reduction for the same reason.

    grid = ProcessGrid(tp=2, cp=2)                       # 8 ranks: dp = 2
    full = GPT(GPTConfig(..., attention="blockwise"), seed=0)
    tp = TensorParallelGPT(full, grid.tp_comm)           # or full itself, without TP
    model = ContextParallelGPT(tp, grid, "ring")         # its cores replace attention's
    sync = TensorParallelSync(tp, dp=NaiveDataParallel(model, grid.dp_cp_comm))
    train_step(model, opt, micro_batches(x, y, step, seed, first_sample=...), lr, clip, dp=sync)

What the lesson reads: model.cp_bytes() ({collective: bytes} the attention exchanges sent
since model.reset_counters(); cp_sent per layer per step is the formula),
model.exposed_s() (seconds spent waiting on the exchange: the ring's Waitall, all of a
blocking collective's time), minidist.attention.STATS (score tiles and elements). In
minidist.comm.stats the ring's messages count under "ring_pass", the others under their
collectives' names ("all_to_all", "all_gather", "reduce_scatter").
Not built: pipeline parallelism around it, mixture of experts, grouped-query attention
(the engine has none: plan/context.py's formulas take n_kv_head). A recomputed forward
(recompute "full", "every-k") repeats its exchange, and the counters count it.
"""
import time

import numpy as np
from mpi4py import MPI

from minidist import fused, recompute
from minidist.attention import (AttentionDropout, attention_partial, attention_partial_backward,
                                merge_partials)
from minidist.backend import to_numpy, xp
from minidist.comm import all_reduce, all_to_all_v, chunk_bounds, ring_all_gather, stats
from minidist.comm.collectives import _reduce_scatter_phase
from minidist.comm.watchdog import waiting
from minidist.failfast import AgreedError
from minidist.parallel.sequence_parallel import sequence_bounds
from minidist.parallel.tensor_parallel import leave_region, sequence_dropout
from minidist.plan.context import VARIANTS
from minidist.rng import DropoutRNG
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
    """[(lo, hi)] of global positions, one per chunk rank holds, in its order."""
    b = chunk_bounds_2cp(seq, cp)
    return [(b[c], b[c + 1]) for c in rank_chunks(rank, cp, load_balance)]


def rank_positions(seq, cp, rank, load_balance=True):
    """The global positions rank holds (an int array, in its chunk order)."""
    ranges = rank_ranges(seq, cp, rank, load_balance)
    return np.concatenate([np.arange(lo, hi) for lo, hi in ranges])

# ----------------------------------------------------------------------------- one ring step


def ring_pass_start(comm, send_arrays, recv_arrays, tag):
    """One ring step, posted: each send array to rank+1, each recv array from rank-1.

    Returns the requests [recv 0, send 0, recv 1, send 1, ...], not waited for: the
    caller computes meanwhile, then waits. (Exercise 13.3.)"""
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


def reduce_scatter_pieces(comm, x, lengths, axis=SEQ):
    """Ring reduce-scatter along `axis` where rank j keeps the piece of lengths[j] (pieces
    in rank order; uneven, unlike ring_reduce_scatter's array_split). Counted under
    "reduce_scatter": rank r sends every piece's partial sum but its own (the ring's rule)."""
    rank = comm.Get_rank()
    with stats.counting("reduce_scatter"), waiting("context parallel: reduce-scatter of dK, dV"):
        rows = np.ascontiguousarray(np.moveaxis(np.asarray(x), axis, 0))
        row = int(np.prod(rows.shape[1:], dtype=np.int64))
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n * row)
        longest = max(lengths) * row
        bufs = [np.empty(longest, x.dtype), np.empty(longest, x.dtype)]
        mine = _reduce_scatter_phase(comm, rows.reshape(-1), bounds, "sum",
                                     lambda step, c: bufs[step % 2][:bounds[c + 1] - bounds[c]])
        mine = np.array(mine).reshape((lengths[rank],) + rows.shape[1:])
        return np.ascontiguousarray(np.moveaxis(mine, 0, axis))

# ----------------------------------------------------------------------------- the attention core


class ContextParallelAttention:
    """One layer's attention core across the cp ranks of `comm`.

    ranges[j]: [(lo, hi)] the position chunks cp rank j holds, in its order (set_layout).
    A query chunk meets a key chunk in one engine call (attention_partial), skipped when
    the causal mask hides it whole; its partials merge by log-sum-exp. Counters, reset by
    reset(): sent {collective: bytes} of this core's data (its collectives' checks apart),
    exposed_s (seconds spent waiting for messages: the communication compute did not
    hide), calls.
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
        drop = AttentionDropout(_dropout_rng(rng), dropout_p, head0) if dropout_p > 0 else None
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

    def _blocking(self, fn, *args):
        """A blocking collective (allgather, Ulysses): all of its time is exposed."""
        t0 = time.perf_counter()
        out = fn(*args)
        self.exposed_s += time.perf_counter() - t0
        return out

    def _pieces(self, rank):
        """[(row offset in rank's arrays, lo, hi)] of rank's chunks."""
        out, off = [], 0
        for lo, hi in self.ranges[rank]:
            out.append((off, lo, hi))
            off += hi - lo
        return out

    def _tokens(self, rank):
        return sum(hi - lo for lo, hi in self.ranges[rank])

    # -- my queries against one rank's keys (ring and allgather)

    def _attend(self, q, k, v, owner, o, lse, drop, poll=None):
        for qo, qlo, qhi in self._pieces(self.rank):
            for ko, klo, khi in self._pieces(owner):
                if klo > qhi - 1:
                    continue                                  # every key after every query
                qs, ks = slice(qo, qo + qhi - qlo), slice(ko, ko + khi - klo)
                o2, l2 = attention_partial(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                           xp.arange(qlo, qhi), xp.arange(klo, khi), self.block,
                                           drop, poll)
                o[:, :, qs], lse[:, :, qs] = merge_partials(o[:, :, qs], lse[:, :, qs], o2, l2)

    def _attend_backward(self, q, k, v, owner, o, lse, do, dq, drop, poll=None):
        dk, dv = xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
        for qo, qlo, qhi in self._pieces(self.rank):
            for ko, klo, khi in self._pieces(owner):
                if klo > qhi - 1:
                    continue
                qs, ks = slice(qo, qo + qhi - qlo), slice(ko, ko + khi - klo)
                g = attention_partial_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                               xp.arange(qlo, qhi), xp.arange(klo, khi),
                                               o[:, :, qs], lse[:, :, qs], do[:, :, qs],
                                               self.block, drop, poll)
                dq[:, :, qs] += g[0]
                dk[:, :, ks] += g[1]
                dv[:, :, ks] += g[2]
        return dk, dv

    def _block_like(self, a, owner):
        """A host buffer for owner's block of an array like `a` (MPI moves host arrays)."""
        shape = list(a.shape)
        shape[SEQ] = self._tokens(owner)
        return np.empty(shape, a.dtype)

    # -- ring: forward and backward

    def ring_forward(self, q, k, v, drop):
        o = xp.zeros(q.shape, q.dtype)
        lse = xp.full(q.shape[:3], -xp.inf, dtype=q.dtype)
        n, r = self.cp, self.rank
        kv = (_host(k), _host(v))
        for s in range(n):
            owner = (r - s) % n                               # whose K, V I hold now
            requests, poll = [], None
            if s < n - 1:                                     # pass it on; take rank r-1's
                nxt = (self._block_like(k, (owner - 1) % n), self._block_like(v, (owner - 1) % n))
                requests = ring_pass(self.comm, kv, nxt, TAG_KV)
                if self.overlap:
                    poll = lambda: MPI.Request.Testall(requests)     # noqa: E731
                else:
                    self._wait(requests)
            k_blk, v_blk = map(xp.asarray, kv)
            self._attend(q, k_blk, v_blk, owner, o, lse, drop, poll)   # my queries, this block
            if requests:
                self._wait(requests)
                kv = nxt
        return o, lse

    def ring_backward(self, q, k, v, o, lse, do, drop):
        n, r = self.cp, self.rank
        dq = xp.zeros(q.shape, q.dtype)
        kv = (_host(k), _host(v))
        own = incoming = None
        sends = []
        for s in range(n):
            owner = (r - s) % n
            requests, poll = [], None
            if s < n - 1:
                nxt = (self._block_like(k, (owner - 1) % n), self._block_like(v, (owner - 1) % n))
                requests = ring_pass(self.comm, kv, nxt, TAG_KV)
                if self.overlap:
                    poll = lambda: MPI.Request.Testall(requests + sends)   # noqa: E731
                else:
                    self._wait(requests)
            k_blk, v_blk = map(xp.asarray, kv)
            dk, dv = self._attend_backward(q, k_blk, v_blk, owner, o, lse, do, dq, drop, poll)
            if s == 0:
                own = (dk, dv)                                # my block, my queries: stays home
            else:
                dk, dv = _host(dk), _host(dv)
                if incoming is not None:                      # the accumulator of this block so far
                    self._wait(incoming[2])
                    dk += incoming[0]
                    dv += incoming[1]
                # the accumulator goes on to rank r+1; the last hop takes it home
                back = (self._block_like(k, (owner - 1) % n), self._block_like(v, (owner - 1) % n))
                reqs = ring_pass(self.comm, (dk, dv), back, TAG_GRAD)
                sends += reqs[1::2]
                incoming = (*back, reqs[0::2])
            if requests:
                self._wait(requests)
                kv = nxt
        dk, dv = own
        if incoming is not None:                              # everyone else's part of my dK, dV
            self._wait(incoming[2])
            dk = dk + xp.asarray(incoming[0])
            dv = dv + xp.asarray(incoming[1])
        self._wait(sends)
        return dq, dk, dv

    # -- allgather: forward and backward

    def _gather(self, a):
        return xp.asarray(self._blocking(ring_all_gather, self.comm, to_numpy(a), SEQ))

    def _split(self, a):
        """A gathered (B, nh, T, hs) array -> each rank's piece, in rank order."""
        out, off = [], 0
        for j in range(self.cp):
            out.append(a[:, :, off:off + self._tokens(j)])
            off += self._tokens(j)
        return out

    def allgather_forward(self, q, k, v, drop):
        o = xp.zeros(q.shape, q.dtype)
        lse = xp.full(q.shape[:3], -xp.inf, dtype=q.dtype)
        ks, vs = self._split(self._gather(k)), self._split(self._gather(v))
        for owner in range(self.cp):
            self._attend(q, ks[owner], vs[owner], owner, o, lse, drop)
        return o, lse

    def allgather_backward(self, q, k, v, o, lse, do, drop):
        ks, vs = self._split(self._gather(k)), self._split(self._gather(v))   # again: not kept
        dq = xp.zeros(q.shape, q.dtype)
        # my queries' part of every rank's dK, dV; then every rank's parts summed, each rank
        # keeping its own tokens' (a reduce-scatter whose pieces are the ranks' token counts)
        dks, dvs = zip(*[self._attend_backward(q, ks[j], vs[j], j, o, lse, do, dq, drop)
                         for j in range(self.cp)])
        lengths = [self._tokens(j) for j in range(self.cp)]
        dk, dv = (self._blocking(reduce_scatter_pieces, self.comm,
                                 to_numpy(xp.concatenate(parts, axis=SEQ)), lengths)
                  for parts in (dks, dvs))
        return dq, xp.asarray(dk), xp.asarray(dv)

    # -- ulysses: the all-to-alls and the attention on my heads

    def _seq_to_heads(self, x):
        """(B, nh, n_r, hs), my tokens of every head -> (B, nh/cp, T, hs), every token of
        my heads, in position order."""
        n = self.cp
        h = x.shape[1] // n
        rows = to_numpy(x).transpose(2, 0, 1, 3)              # (n_r, B, nh, hs)
        heads_of = [rows[:, :, j * h:(j + 1) * h] for j in range(n)]     # rank j's heads go to j
        got = self._blocking(all_to_all_v, self.comm, heads_of)
        whole = np.empty((sum(len(g) for g in got),) + got[0].shape[1:], x.dtype)
        for j, g in enumerate(got):
            whole[self._positions(j)] = g                     # rank j's tokens, in their places
        return xp.asarray(np.ascontiguousarray(whole.transpose(1, 2, 0, 3)))

    def _heads_to_seq(self, y):
        """The inverse: (B, nh/cp, T, hs) -> (B, nh, n_r, hs)."""
        rows = to_numpy(y).transpose(2, 0, 1, 3)              # (T, B, nh/cp, hs)
        tokens_of = [rows[self._positions(j)] for j in range(self.cp)]    # rank j's tokens go to j
        got = self._blocking(all_to_all_v, self.comm, tokens_of)
        mine = np.concatenate(got, axis=2)                    # heads in rank order
        return xp.asarray(np.ascontiguousarray(mine.transpose(1, 2, 0, 3)))

    def _positions(self, rank):
        return np.concatenate([np.arange(lo, hi) for lo, hi in self.ranges[rank]])

    def ulysses_forward(self, q, k, v, drop):
        Q, K, V = (self._seq_to_heads(a) for a in (q, k, v))
        pos = xp.arange(Q.shape[SEQ])
        O, L = attention_partial(Q, K, V, pos, pos, self.block, drop)
        return self._heads_to_seq(O), (Q, K, V, O, L)

    def ulysses_backward(self, saved, do, drop):
        Q, K, V, O, L = saved
        dO = self._seq_to_heads(do)
        pos = xp.arange(Q.shape[SEQ])
        dQ, dK, dV = attention_partial_backward(Q, K, V, pos, pos, O, L, dO, self.block, drop)
        return tuple(self._heads_to_seq(g) for g in (dQ, dK, dV))


def _host(a):
    """A contiguous host (NumPy) copy of a backend array: what MPI sends (a view on the CPU
    when it is contiguous already)."""
    return np.ascontiguousarray(to_numpy(a))


def _dropout_rng(rng):
    """The DropoutRNG behind a view of it (PositionsRNG, SlicedRNG)."""
    while rng is not None and not hasattr(rng, "calls") and hasattr(rng, "rng"):
        rng = rng.rng
    return rng


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
            if core.variant == "ulysses":
                o, saved = core.ulysses_forward(q, k, v, dropout)
                ctx.save_for_backward(*saved)
            else:
                run = core.ring_forward if core.variant == "ring" else core.allgather_forward
                o, lse = run(q, k, v, dropout)
                ctx.save_for_backward(q, k, v, o, lse)
        core._count(m)
        return o

    @staticmethod
    def backward(ctx, grad):
        core = ctx.core
        with stats.measure() as m:
            if core.variant == "ulysses":
                out = core.ulysses_backward(ctx.saved, grad, ctx.dropout)
            elif core.variant == "ring":
                out = core.ring_backward(*ctx.saved, grad, ctx.dropout)
            else:
                out = core.allgather_backward(*ctx.saved, grad, ctx.dropout)
        core._count(m)
        return out

# ----------------------------------------------------------------------------- the loss


class SumOverContext(Function):
    """Forward: the sum of each cp rank's loss share (a ring all-reduce of one number: the
    mean over every token of the sequence). Backward: the gradient times cp.

    Each rank's backward then carries cp times its tokens' share of the gradient; averaged
    over the dp x cp ranks (DataParallel on grid.dp_cp_comm) the cp shares add up to the
    whole gradient (Megatron-LM scales the loss by the CP size for the same reason)."""

    @staticmethod
    def forward(ctx, x, comm=None):
        ctx.cp = comm.Get_size()
        return xp.asarray(all_reduce(comm, to_numpy(x).reshape(1), op="sum").reshape(x.shape))

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp


class PositionsRNG:
    """A DropoutRNG seen at my positions: mask((B, n_r, ...)) draws the whole (B, T, ...)
    mask one process draws and keeps the columns of my positions (axis 1)."""

    def __init__(self, rng, seq, positions):
        self.rng, self.seq, self.positions = rng, seq, xp.asarray(positions)

    def mask(self, shape, p, dtype):
        whole = self.rng.mask((shape[0], self.seq) + tuple(shape[2:]), p, dtype)
        return xp.ascontiguousarray(whole[:, self.positions])

# ----------------------------------------------------------------------------- the model


class ContextParallelGPT:
    """A GPT or a TensorParallelGPT whose sequence is cut across the cp ranks of a group.

    model: the whole GPT (every rank builds it from the seed) or a TensorParallelGPT made
    from it (sequence parallelism too: each TP rank then keeps a slice of my tokens).
    grid_or_comm: a ProcessGrid (its cp_comm) or the cp communicator itself. Parameters
    keep their names (this object holds none of its own). forward(idx, targets, rng) takes
    the whole (B, T) rows and returns (logits of my positions, the loss over all tokens).
    Weight gradients: NaiveDataParallel or BucketedDataParallel over grid.dp_cp_comm
    (with TP: TensorParallelSync(tp_model, dp=that)).
    """

    def __init__(self, model, grid_or_comm, variant="ring", load_balance=True, overlap=True,
                 block=None):
        comm = getattr(grid_or_comm, "cp_comm", grid_or_comm)
        cfg = model.config
        check_variant(variant)
        if cfg.n_expert > 0:
            raise CPError("context parallelism with mixture of experts is not built: each rank "
                          "would route only its tokens, and the auxiliary losses are per rank")
        self.model, self.config, self.comm = model, cfg, comm
        self.cp, self.cp_rank = comm.Get_size(), comm.Get_rank()
        self.tp_comm = getattr(model, "comm", None)             # a TensorParallelGPT's group
        heads = cfg.n_head // (self.tp_comm.Get_size() if self.tp_comm is not None else 1)
        if variant == "ulysses" and heads % self.cp:
            raise CPError(f"Ulysses gives each of the cp={self.cp} ranks n_head/cp heads: "
                          f"{heads} heads" + (" per tensor-parallel rank" if self.tp_comm else "")
                          + f" do not divide by {self.cp}; choose cp among "
                          + ", ".join(str(c) for c in range(1, heads + 1) if heads % c == 0))
        self.variant, self.load_balance = variant, load_balance
        block = block or getattr(cfg, "attn_block", 64)
        self.cores = [ContextParallelAttention(comm, variant, block, overlap)
                      for _ in model.transformer.h]
        for b, core in zip(model.transformer.h, self.cores):
            b.attn.core = core
        self.seed, self._calls, self.positions = model.seed, 0, None

    # -- the model's face

    def named_parameters(self):
        return self.model.named_parameters()

    def parameters(self):
        return self.model.parameters()

    def train(self, mode=True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def training(self):
        return self.model.training

    def configure_optimizers(self, weight_decay, lr, betas=(0.9, 0.95), eps=1e-8):
        return self.model.configure_optimizers(weight_decay, lr, betas, eps)

    def __call__(self, *args, **kw):
        return self.forward(*args, **kw)

    # -- what the lesson reads

    def reset_counters(self):
        for c in self.cores:
            c.reset()

    def cp_bytes(self):
        """{collective: bytes} this rank's attention exchanges sent since reset_counters()."""
        out = {}
        for c in self.cores:
            for name, n in c.sent.items():
                out[name] = out.get(name, 0) + n
        return out

    def exposed_s(self):
        """Seconds this rank waited for the ring's messages since reset_counters()."""
        return sum(c.exposed_s for c in self.cores)

    def layout(self, seq):
        """[(lo, hi), ...] per cp rank: the position chunks each holds."""
        return [rank_ranges(seq, self.cp, j, self.load_balance) for j in range(self.cp)]

    # -- forward

    def forward(self, idx, targets=None, rng=None):
        idx = xp.asarray(idx)
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size "
                             f"{self.config.block_size}")
        if T < 2 * self.cp:
            raise CPError(f"a sequence of {T} tokens cannot be cut into 2 cp = {2 * self.cp} "
                          f"chunks of at least one token: use cp <= {max(1, T // 2)}")
        ranges = self.layout(T)
        for c in self.cores:
            c.set_layout(ranges)
        pos = xp.asarray(rank_positions(T, self.cp, self.cp_rank, self.load_balance))
        self.positions = pos
        p = self.config.dropout if self.training else 0.0
        if rng is None and self.training and self.config.dropout > 0:
            rng = DropoutRNG(self.seed, self._calls, range(B))   # as GPT.forward does
            self._calls += 1
        mine = PositionsRNG(rng, T, pos) if rng is not None else None
        m, tr = self.model, self.model.transformer
        if self.tp_comm is None:
            x = tr.drop(tr.wte(idx[:, pos]) + tr.wpe(pos), mine)              # (B, n_r, C)
            x = recompute.run_blocks(m.recompute, tr.h, x, mine)
            logits, loss = tr.ln_f(x) @ tr.wte.weight.T, None                   # (B, n_r, V)
            if targets is not None:
                loss = fused.cross_entropy(logits, xp.asarray(targets)[:, pos])   # my tokens' mean
        else:
            sp, n = m.sequence_parallel, len(pos)
            lo, hi = sequence_bounds(n, self.tp_comm) if sp else (0, n)
            seq = (n, lo, hi) if sp else None
            tok = leave_region(tr.wte(idx[:, pos]), self.tp_comm, sp)   # (B, n_r or my slice, C)
            x = sequence_dropout(tok + tr.wpe(pos[lo:hi]), p, mine, seq)
            x = recompute.run_blocks(m.recompute, tr.h, x, mine, seq)
            logits, loss = m.head(x, None if targets is None else xp.asarray(targets)[:, pos], sp)
        if loss is not None:            # my tokens' mean x my share of the tokens, summed over cp
            loss = SumOverContext.apply(loss * (len(pos) / T), comm=self.comm)
        return logits, loss
