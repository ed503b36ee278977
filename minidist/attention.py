"""Memory-efficient (blockwise) causal attention: the online softmax over key tiles.

    python -c "from minidist.attention import blockwise_attention; help(blockwise_attention)"

Plain attention (fused.CausalAttention) builds the (T, T) scores of every head, keeps the
probabilities for backward and, with dropout, the mask too: Korthikanti et al.'s 5as^2b
term (arXiv 2205.05198, section 4.1), which grows as the square of the sequence. Here the
scores are made one tile at a time, `block` queries x `block` keys, and never kept.

Forward, the online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867, Algorithm 3;
Rabe & Staats 2021, arXiv 2112.05682, sections 2-3; FlashAttention, Dao et al. 2022,
arXiv 2205.14135, Algorithm 1 in section 3.1, with masking and dropout Algorithm 2 in
Appendix B.3). For each query tile, every row keeps a running max m, a running sum l
and an unnormalised output acc; a key tile with scores S = q k^T / sqrt(hs) (masked
entries -inf) gives
    m' = max(m, rowmax S),  P = exp(S - m'),  l = exp(m - m') l + rowsum P,
    acc = exp(m - m') acc + (P * Z) v,  m = m'       (Z: the dropout mask, 0 or 1/(1-p))
and at the end o = acc / l and the row's log-sum-exp lse = m + log l (dropout scales
what reaches v, not l: o = (softmax * Z) v, as the plain attention computes it).
Saved for backward, as FlashAttention-2 keeps them (Dao 2023, arXiv 2307.08691, section
3.1): q, k, v, o (B, nh, T, hs each) and lse (B, nh, T): 4bsh + bas numbers per layer
(b*s*h/t and b*a*s/t each under tensor parallelism), no (T, T) array; plan/memory.py
counts them (engine_layer_saves(..., attention="blockwise")).

Backward, FlashAttention's Algorithm 4 (Dao et al. 2022, Appendix B.4; FlashAttention-2's
Algorithm 2, keys in the outer loop as here): D = rowsum(dO * O) once; per tile the
probabilities are recomputed from the saved lse, P = exp(S - lse), and
    dV += (P*Z)^T dO,  dP = (dO V^T) * Z,  dS = P * (dP - D),
    dQ += dS K / sqrt(hs),  dK += dS^T Q / sqrt(hs)
(D = rowsum(P * dP) because O = (P*Z) V: the softmax's backward without the (T, T) P).
Work: forward one tile product q k^T and one (P*Z) v per tile; backward recomputes
q k^T and adds four more products per tile.

Masks go by GLOBAL positions (q_pos, k_pos): query i sees key j iff k_pos[j] <= q_pos[i],
so the same functions serve causal self-attention (positions arange(T)) and a rank of
context parallelism holding zigzag chunks of the sequence against some other rank's keys.
A tile that the rule masks entirely is skipped (neither computed nor counted in STATS); a
tile that it leaves entirely visible gets no mask at all. The partial results over two
disjoint key sets merge exactly (merge_partials), the ring attention's step.

Attention dropout is drawn from each element's global (sample, head, query position,
key position) by a counter-based hash (rng.position_keep_mask), so every tiling, every
split of the sequence or of the heads, draws the same mask, and backward redraws it per
tile instead of keeping it. The loop is over tiles; (B, nh) is vectorised.

On a device the positions are held twice (`Positions`): on the host, for the tile
arithmetic (which tiles run or are skipped, how many scores STATS counts: plain Python
numbers, no device array read back per tile), and on the device, for the masks and the
dropout hash. Given either, the other is one counted copy per call; `Positions.arange`
makes both without any.
"""
import math

import numpy

from minidist.backend import on_device, to_device, to_numpy, xp
from minidist.rng import position_key, position_keep_mask
from minidist.tensor import Function

# ----------------------------------------------------------------------------- work counters


class Stats:
    """Work this process's blockwise attention did, forward and backward apart.

    tiles_*: score tiles computed (a (block, block) grid of (query, key) pairs at most,
    each for all B x nh heads at once); scores_*: the unmasked score elements of those
    tiles, summed over the B x nh (sample, head) pairs. Masked tiles are not computed and
    count nothing. `tiles` and `scores` are the forward's and backward's together.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.tiles_forward = self.tiles_backward = 0
        self.scores_forward = self.scores_backward = 0

    @property
    def tiles(self):
        return self.tiles_forward + self.tiles_backward

    @property
    def scores(self):
        return self.scores_forward + self.scores_backward

    def __repr__(self):
        return (f"Stats(tiles_forward={self.tiles_forward}, tiles_backward={self.tiles_backward}, "
                f"scores_forward={self.scores_forward}, scores_backward={self.scores_backward})")


STATS = Stats()

# ----------------------------------------------------------------------------- dropout by position


class AttentionDropout:
    """The attention-probability dropout of one forward, drawn from global positions.

    rng: the forward's DropoutRNG (its sample_ids name the batch rows). Taking one advances
    rng.calls by exactly one, as the plain attention's single rng.mask call does, so every
    later mask of the forward is the one it would be; the call number k is kept, so the
    backward (or a recomputation) redraws the same mask. head0: the global index of the
    first head this process holds (tensor parallelism or Ulysses hold a slice of them).
    """

    def __init__(self, rng, p, head0=0):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), not {p}")
        self.seed, self.step, self.sample_ids = rng.seed, rng.step, list(rng.sample_ids)
        self.k, rng.calls = rng.calls, rng.calls + 1
        self.p, self.head0 = float(p), int(head0)
        self._key = None                   # rng.position_key, made (and copied over) once

    def keep(self, heads, q_pos, k_pos, dtype):
        """Scaled mask (B, len(heads), len(q_pos), len(k_pos)) of 0 and 1/(1-p); heads are
        this process's head indices (global head = head0 + heads)."""
        if self._key is None:
            self._key = position_key(self.seed, self.step, self.sample_ids, self.k)
        heads = heads if on_device(heads) else to_device(numpy.asarray(heads, dtype=numpy.int64))
        heads = heads.astype(xp.int64) + self.head0
        return position_keep_mask(self.seed, self.step, self.sample_ids, self.k, heads,
                                  _device(q_pos), _device(k_pos), self.p, dtype, key=self._key)


class PositionalMaskRNG:
    """A stand-in for a DropoutRNG whose mask(shape, p, dtype) is the positional attention
    mask of the whole (B, nh, Tq, Tk) grid: hand it to the plain attention
    (fused.causal_attention) to get the masks the blockwise one draws, for comparison."""

    def __init__(self, rng, head0=0, q_pos=None, k_pos=None):
        self.rng, self.head0, self.q_pos, self.k_pos = rng, head0, q_pos, k_pos

    def mask(self, shape, p, dtype):
        B, nh, Tq, Tk = shape
        q_pos = xp.arange(Tq) if self.q_pos is None else _device(self.q_pos)
        k_pos = xp.arange(Tk) if self.k_pos is None else _device(self.k_pos)
        return AttentionDropout(self.rng, p, self.head0).keep(xp.arange(nh), q_pos, k_pos, dtype)

# ----------------------------------------------------------------------------- positions, tiles


class Positions:
    """Global positions on both sides: `host` (a NumPy array: tile arithmetic, counts) and
    `device` (an xp array: masks, the dropout hash). On the CPU they are one array."""
    __slots__ = ("host", "device")

    def __init__(self, host, device):
        self.host, self.device = host, device

    @classmethod
    def arange(cls, lo, hi=None):
        """Positions lo..hi-1 (0..lo-1 with one argument), made on each side: nothing copied."""
        lo, hi = (0, lo) if hi is None else (lo, hi)
        host = numpy.arange(lo, hi)
        return cls(host, host if xp is numpy else xp.arange(lo, hi))

    def __len__(self):
        return len(self.host)


def positions(pos):
    """pos (host or device integers, or Positions) as Positions: the side it is not on is
    one counted copy (none for Positions, or on the CPU)."""
    if isinstance(pos, Positions):
        return pos
    if on_device(pos):
        return Positions(to_numpy(pos), pos)
    host = numpy.asarray(pos)
    return Positions(host, to_device(host))


def _device(pos):
    """The device side of Positions; other positions as they are (the hash copies host ones)."""
    return pos.device if isinstance(pos, Positions) else pos


def _tiles(pos, block):
    """[(lo, hi, min position, max position)] of consecutive tiles of `block` entries
    (pos: Positions; read on the host)."""
    h = pos.host
    return [(lo, min(lo + block, len(h)), int(h[lo:lo + block].min()),
             int(h[lo:lo + block].max())) for lo in range(0, len(h), block)]


def _visible(q_tile, k_tile, q_pos, k_pos):
    """None: no key of the tile is visible to any query; True: all are (no mask needed);
    else (the (bq, bk) boolean mask k_pos <= q_pos of the tile on the device, how many of
    its entries are True, counted on the host)."""
    qlo, qhi, qmin, qmax = q_tile
    klo, khi, kmin, kmax = k_tile
    if kmin > qmax:
        return None
    if kmax <= qmin:
        return True
    seen = int(numpy.count_nonzero(k_pos.host[None, klo:khi] <= q_pos.host[qlo:qhi, None]))
    return k_pos.device[None, klo:khi] <= q_pos.device[qlo:qhi, None], seen


def _check(q, k, v, q_pos, k_pos, block):
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected q (B, nh, Tq, hs) and "
                         f"k, v (B, nh, Tk, hs)")
    q_pos, k_pos = positions(q_pos), positions(k_pos)
    if q_pos.host.shape != (q.shape[2],) or k_pos.host.shape != (k.shape[2],):
        raise ValueError(f"q_pos {q_pos.host.shape} and k_pos {k_pos.host.shape} must name the "
                         f"{q.shape[2]} queries and the {k.shape[2]} keys")
    if int(block) != block or block < 1:
        raise ValueError(f"block must be a whole number of positions, at least 1, not {block}")
    return q_pos, k_pos, int(block)


def attention_partial(q, k, v, q_pos, k_pos, block=64, dropout=None, poll=None):
    """Attention of q over THIS key set: (o, lse), the online softmax tile by tile.

    q (B, nh, Tq, hs); k, v (B, nh, Tk, hs); q_pos (Tq,), k_pos (Tk,) global positions.
    o (B, nh, Tq, hs) is normalised over these keys only, lse (B, nh, Tq) the natural-log
    log-sum-exp of the scaled, masked scores over them; a row that sees no key here has
    o = 0 and lse = -inf. dropout: an AttentionDropout (or None). poll: called with no
    argument between tiles (lets posted MPI messages progress).
    """
    q_pos, k_pos, block = _check(q, k, v, q_pos, k_pos, block)
    B, nh, Tq, hs = q.shape
    qs = q * (1.0 / math.sqrt(hs))
    o = xp.zeros(q.shape, dtype=q.dtype)
    lse = xp.full((B, nh, Tq), -xp.inf, dtype=q.dtype)
    heads = xp.arange(nh)
    k_tiles = _tiles(k_pos, block)
    for qt in _tiles(q_pos, block):
        i0, i1 = qt[0], qt[1]
        m = l = acc = None                                        # running max, sum, output
        for kt in k_tiles:
            vis = _visible(qt, kt, q_pos, k_pos)
            if vis is None:
                continue                                          # masked whole: skipped
            j0, j1 = kt[0], kt[1]
            s = qs[:, :, i0:i1] @ k[:, :, j0:j1].swapaxes(-1, -2)  # (B, nh, bq, bk)
            if vis is not True:
                s[..., ~vis[0]] = -xp.inf
            STATS.tiles_forward += 1
            STATS.scores_forward += B * nh * ((i1 - i0) * (j1 - j0) if vis is True else vis[1])
            m_new = s.max(axis=-1)                                # (B, nh, bq)
            if m is not None:
                xp.maximum(m_new, m, out=m_new)
            m_safe = xp.where(m_new == -xp.inf, 0.0, m_new)       # a row that saw no key yet
            s -= m_safe[..., None]
            xp.exp(s, out=s)                                      # P, unnormalised
            if m is None:
                l = s.sum(axis=-1)
            else:
                alpha = xp.exp(m - m_safe)                        # rescale what came before
                l *= alpha
                l += s.sum(axis=-1)
                acc *= alpha[..., None]
            if dropout is not None:
                s *= dropout.keep(heads, q_pos.device[i0:i1], k_pos.device[j0:j1], s.dtype)
            pv = s @ v[:, :, j0:j1]                               # (B, nh, bq, hs)
            if acc is None:
                acc = pv
            else:
                acc += pv
            m = m_new
            if poll is not None:
                poll()
        if m is None:
            continue                                              # no key visible to this tile
        seen = l > 0
        o[:, :, i0:i1] = acc / xp.where(seen, l, 1.0)[..., None]
        lse[:, :, i0:i1] = xp.where(seen, m + xp.log(xp.where(seen, l, 1.0)), -xp.inf)
    return o, lse


def attention_partial_backward(q, k, v, q_pos, k_pos, o, lse, do, block=64, dropout=None,
                               poll=None):
    """FlashAttention's backward over THIS key set: (dq part, dk, dv).

    o, lse: the FINAL output and log-sum-exp (merged over every key set the queries
    attend), do: the final output's gradient. P = exp(S - lse) is then the final
    probabilities restricted to these keys, and with D = rowsum(do * o):
    dv = (P*Z)^T do, dS = P * ((do v^T) * Z - D), dq = dS k / sqrt(hs), dk = dS^T q / sqrt(hs).
    dq is these keys' part only (sum the parts of all key sets); dk, dv are this k's and v's.
    """
    q_pos, k_pos, block = _check(q, k, v, q_pos, k_pos, block)
    B, nh, Tq, hs = q.shape
    scale = 1.0 / math.sqrt(hs)
    qs = q * scale
    d = (do * o).sum(axis=-1)                                     # D (B, nh, Tq)
    lse = xp.where(lse == -xp.inf, xp.inf, lse)                   # a row seeing no key: P = 0
    dq, dk, dv = xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    heads = xp.arange(nh)
    q_tiles = _tiles(q_pos, block)
    for kt in _tiles(k_pos, block):                              # Algorithm 2: keys outer
        j0, j1 = kt[0], kt[1]
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]
        for qt in q_tiles:
            vis = _visible(qt, kt, q_pos, k_pos)
            if vis is None:
                continue
            i0, i1 = qt[0], qt[1]
            p = qs[:, :, i0:i1] @ kj.swapaxes(-1, -2)             # S (B, nh, bq, bk)
            if vis is not True:
                p[..., ~vis[0]] = -xp.inf
            STATS.tiles_backward += 1
            STATS.scores_backward += B * nh * ((i1 - i0) * (j1 - j0) if vis is True else vis[1])
            p -= lse[:, :, i0:i1, None]
            xp.exp(p, out=p)                                      # P = exp(S - lse)
            doi = do[:, :, i0:i1]
            dp = doi @ vj.swapaxes(-1, -2)                        # dO V^T
            if dropout is not None:
                z = dropout.keep(heads, q_pos.device[i0:i1], k_pos.device[j0:j1], p.dtype)
                dp *= z
                z *= p                                            # P * Z
                dv[:, :, j0:j1] += z.swapaxes(-1, -2) @ doi
            else:
                dv[:, :, j0:j1] += p.swapaxes(-1, -2) @ doi
            dp -= d[:, :, i0:i1, None]
            dp *= p                                               # dS
            dq[:, :, i0:i1] += dp @ kj
            dk[:, :, j0:j1] += dp.swapaxes(-1, -2) @ qs[:, :, i0:i1]
            if poll is not None:
                poll()
    dq *= scale
    return dq, dk, dv


def merge_partials(o1, lse1, o2, lse2):
    """Two partial results over disjoint key sets -> the result over both (exact).

    lse = log(exp lse1 + exp lse2), o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2: each part
    was normalised by its own sum exp(lse_i); rescaling by exp(lse_i - lse) renormalises it
    by the joint sum. A row with lse = -inf on one side takes the other side whole; on
    both, it stays o = 0, lse = -inf.
    """
    lse = xp.logaddexp(lse1, lse2)
    safe = xp.where(lse == -xp.inf, 0.0, lse)
    o = xp.exp(lse1 - safe)[..., None] * o1
    o += xp.exp(lse2 - safe)[..., None] * o2
    return o, lse

# ----------------------------------------------------------------------------- the engine Function


class BlockwiseAttention(Function):
    """softmax(q k^T / sqrt(hs) + mask by positions) (dropout) @ v, tile by tile, in one node.

    forward: attention_partial over all keys; saves q, k, v, o and lse (no (T, T) array).
    backward: attention_partial_backward, recomputing each tile's probabilities from lse.
    """

    @staticmethod
    def forward(ctx, q, k, v, dropout_p=0.0, rng=None, block=64, q_pos=None, k_pos=None, head0=0):
        q_pos = Positions.arange(q.shape[2]) if q_pos is None else positions(q_pos)
        k_pos = Positions.arange(k.shape[2]) if k_pos is None else positions(k_pos)
        dropout = AttentionDropout(rng, dropout_p, head0) if dropout_p > 0 else None
        o, lse = attention_partial(q, k, v, q_pos, k_pos, block, dropout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.q_pos, ctx.k_pos, ctx.block, ctx.dropout = q_pos, k_pos, block, dropout
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse = ctx.saved
        return attention_partial_backward(q, k, v, ctx.q_pos, ctx.k_pos, o, lse, grad, ctx.block,
                                          ctx.dropout)


def blockwise_attention(q, k, v, dropout_p=0.0, rng=None, block=64, q_pos=None, k_pos=None,
                        head0=0):
    """Memory-efficient attention of (B, nh, T, hs) Tensors; causal self-attention by default
    (positions arange(T)). rng: the forward's DropoutRNG, needed when dropout_p > 0."""
    if dropout_p > 0 and rng is None:
        raise ValueError("attention dropout needs the forward's DropoutRNG (rng=...)")
    return BlockwiseAttention.apply(q, k, v, dropout_p=dropout_p, rng=rng, block=block, q_pos=q_pos,
                                    k_pos=k_pos, head0=head0)


class BlockwiseCore:
    """The attention core a GPT built with attention="blockwise" calls in each layer:
    core(q, k, v, dropout_p, rng, head0) -> y (B, nh, T, hs), positions arange(T)."""

    def __init__(self, block=64):
        self.block = int(block)

    def __call__(self, q, k, v, dropout_p, rng, head0=0):
        return blockwise_attention(q, k, v, dropout_p, rng if dropout_p > 0 else None, self.block,
                                   head0=head0)

    def __repr__(self):
        return f"BlockwiseCore(block={self.block})"
