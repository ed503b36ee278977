"""Context parallelism in numbers: the bytes each rank's attention exchange sends, and the
attention work each rank does, as minidist/parallel/context_parallel.py does them.

    python -c "from minidist.plan.context import *; print(cp_layer_bytes('ring', 1, 8192, 32, 128, 4, 2))"

Pure arithmetic (no MPI, nothing of minidist outside plan/): the planner, the lesson and
the tests call it; the tests hold the engine's counters equal to it, to the byte.

The layout (Megatron-LM's, for causal attention): the sequence of s tokens is cut into
2 cp chunks by numpy.array_split (when s does not divide, the first s mod 2cp chunks are
one token longer); rank r holds chunks r and 2cp-1-r (load balanced) or chunks 2r and
2r+1 (naive, contiguous). n_r is the number of tokens rank r holds. Computed here again,
on purpose, from the same words: the code and the formula are two witnesses.

Bytes per rank per layer per training step (forward + backward), e = b x kv x hd x
itemsize the bytes of one token's K (or V) for b sequences, kv key/value heads of hd:

  ring (ring attention, Liu et al. 2023, arXiv 2310.01889; "pass-KV" is Yang et al.
      2024's name, arXiv 2411.01783; Megatron-LM's default, --cp-comm-type p2p):
      forward, cp-1 steps each pass the K, V block held on to the next rank, the blocks
      of ranks r, r-1, ..., r-cp+2: 2e (s - n_{r+1}); backward the same K, V again, and
      the dK, dV accumulators of blocks r-1, ..., r-cp+1 (each block's accumulator
      leaves its owner empty: it starts on the next rank and comes home after cp-1
      hops): 2e (s - n_r). With equal chunks, n = s/cp: 6 (cp-1) b n kv hd itemsize (2
      (cp-1) K, V blocks forward; 2 (cp-1) K, V and 2 (cp-1) dK, dV backward).
  ulysses (DeepSpeed-Ulysses; Jacobs et al. 2023, arXiv 2309.14509; Megatron's a2a, and
      a2a+p2p nests it in a ring): all-to-all of q, k, v from sequence to heads (my n_r
      tokens of the other ranks' heads: n_r (cp-1)/cp of the heads), the output back
      from heads to sequence (my h/cp heads of the other ranks' s - n_r tokens);
      backward the mirror: dO forward, dQ, dK, dV back. (2h + 2kv) [n_r (cp-1)/cp + (s -
      n_r)/cp] b hd itemsize; equal chunks: 4 (h + kv) (cp-1)/cp b n hd itemsize.
  allgather (the forward Llama 3 describes: Grattafiori et al. 2024, arXiv 2407.21783,
      section 3.3.2; Megatron-LM's all_gather): ring all-gather of K and V (each rank
      forwards the pieces of ranks r, ..., r-cp+2: s - n_{r+1} tokens); the backward, not
      in the paper, is Transformer Engine's and this project's choice: the all-gather
      again (nothing gathered is kept), and a ring reduce-scatter of dK, dV with each
      rank's own pieces as the bounds (it forwards partial sums of ranks r-1, ...,
      r-cp+1: s - n_r tokens): 2e [2 (s - n_{r+1}) + (s - n_r)]; equal chunks 6 (cp-1)
      b n kv hd itemsize, the ring's bytes in 3 collectives instead of 2 (cp-1) sends.

With grouped-query attention (kv < h) the ring and the all-gather move kv/h of Ulysses'
K, V share; Llama 3's 8 KV heads of 128 made its all-gather small. Under tensor
parallelism pass the heads of one TP rank (h/t, kv/t).

Attention work (score tiles of `block` x `block`): the engine attends each of my query
chunks to each key chunk (ring, allgather), skipping a tile whose every key comes after
every query (causal). Chunk a against an earlier chunk c: every tile; against itself: the
triangle, nt(nt+1)/2 tiles of nt = ceil(len/block); against a later one: none. Balanced,
rank r's chunks r and 2cp-1-r see r + (2cp-1-r) = 2cp-1 earlier chunks whatever r is, so
every rank computes the same tiles ON CONDITION that every chunk spans as many tiles,
ceil(len/block): always when `block` divides the chunk length s/(2cp). When s does not
divide by 2cp and the longer chunks need one more tile, it fails, and by many tiles
(s = 29, cp = 3, block = 2: 39, 57, 57); the score elements below stay balanced to
within the uneven token (125, 155, 155). Naive, rank r's chunks 2r, 2r+1 see 4r+1
earlier chunks. Unmasked scores per head and sequence: the sum
over my positions p of (p + 1); contiguous (naive) with n = s/cp tokens per rank, rank
cp-1 over rank 0 is ((2cp-1) n + 1)/(n + 1), to (2cp-1):1 for long sequences; balanced
with 2cp dividing s: equal. Ulysses attends the whole sequence on h/cp heads: equal.
"""
VARIANTS = ("ring", "ulysses", "allgather")


def check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"unknown context-parallel variant {variant!r}: choose one of "
                         f"{', '.join(VARIANTS)}")


def chunk_lengths(seq, cp):
    """Lengths of the 2 cp chunks of numpy.array_split(range(seq), 2 cp)."""
    q, r = divmod(seq, 2 * cp)
    return [q + (c < r) for c in range(2 * cp)]


def chunks_of(rank, cp, load_balance=True):
    """The chunk indices rank holds: [r, 2cp-1-r] balanced, [2r, 2r+1] naive."""
    return [rank, 2 * cp - 1 - rank] if load_balance else [2 * rank, 2 * rank + 1]


def tokens_of(seq, cp, rank, load_balance=True):
    """n_r: how many of the sequence's tokens rank holds."""
    lengths = chunk_lengths(seq, cp)
    return sum(lengths[c] for c in chunks_of(rank, cp, load_balance))


def cp_sent(variant, batch, seq, n_head, head_dim, cp, rank, itemsize, load_balance=True,
            n_kv_head=None):
    """Bytes rank's attention exchange sends per layer per training step (forward and
    backward), exactly as context_parallel.py sends them, uneven chunks included
    (module docstring). n_head, n_kv_head: the heads this rank's attention holds."""
    check_variant(variant)
    if cp == 1:
        return 0
    kv = n_head if n_kv_head is None else n_kv_head
    n = [tokens_of(seq, cp, r, load_balance) for r in range(cp)]
    mine, nxt = n[rank], n[(rank + 1) % cp]
    tok = batch * head_dim * itemsize                     # one head of one token, b sequences
    if variant == "ring":
        return 2 * kv * tok * (seq - nxt) * 2 + 2 * kv * tok * (seq - mine)
    if variant == "allgather":
        return 2 * kv * tok * (2 * (seq - nxt) + (seq - mine))
    heads = 2 * n_head + 2 * kv                           # q, o, dO, dQ and k, v, dK, dV
    return heads * tok * (mine * (cp - 1) + (seq - mine)) // cp


def cp_layer_bytes(variant, batch, seq, n_head, head_dim, cp, itemsize, n_kv_head=None):
    """The papers' bytes per rank per layer per training step, equal chunks (n = s/cp):
    ring and allgather 6 (cp-1) b n kv hd, ulysses 4 (h + kv) (cp-1)/cp b n hd; times
    itemsize. Equal to cp_sent on every rank when every rank holds s/cp tokens (always
    when 2 cp divides s)."""
    check_variant(variant)
    kv = n_head if n_kv_head is None else n_kv_head
    if variant in ("ring", "allgather"):
        out = 6 * (cp - 1) * batch * seq * kv * head_dim * itemsize / cp
    else:
        out = 4 * (n_head + kv) * (cp - 1) * batch * seq * head_dim * itemsize / (cp * cp)
    return int(out) if out == int(out) else out


# ----------------------------------------------------------------------------- attention work

def tiles(q_lo, q_hi, k_lo, k_hi, block):
    """Score tiles computed for queries at positions q_lo..q_hi-1 against keys
    k_lo..k_hi-1, each cut in tiles of `block` from its first position: a tile is
    computed unless its first key comes after its last query (the causal mask hides it all)."""
    n = 0
    for qa in range(q_lo, q_hi, block):
        last_q = min(qa + block, q_hi) - 1
        n += sum(1 for ka in range(k_lo, k_hi, block) if ka <= last_q)
    return n


def chunk_range(seq, cp, c):
    lengths = chunk_lengths(seq, cp)
    lo = sum(lengths[:c])
    return lo, lo + lengths[c]


def attention_tiles(variant, seq, cp, rank, block, load_balance=True):
    """Score tiles (of block x block, over all heads and sequences of the rank at once)
    rank computes in one attention forward (its backward recomputes as many): ring and
    allgather, each of my chunks against each of the 2 cp chunks; ulysses, the whole
    sequence's triangle (on h/cp heads). cp = 1: the one process's triangle."""
    check_variant(variant)
    if variant == "ulysses" or cp == 1:
        return tiles(0, seq, 0, seq, block)
    return sum(tiles(*chunk_range(seq, cp, a), *chunk_range(seq, cp, c), block)
               for a in chunks_of(rank, cp, load_balance) for c in range(2 * cp))


def attention_scores(variant, batch, seq, n_head, cp, rank, load_balance=True):
    """Unmasked score elements (query, key) rank computes in one attention forward, over
    its batch sequences and n_head heads: ring and allgather, sum over my positions p of
    p + 1, on every head; ulysses, the whole triangle s (s + 1)/2 on n_head/cp heads."""
    check_variant(variant)
    if variant == "ulysses" or cp == 1:
        return batch * (n_head // cp) * seq * (seq + 1) // 2
    total = 0
    for c in chunks_of(rank, cp, load_balance):
        lo, hi = chunk_range(seq, cp, c)
        total += (hi * (hi + 1) - lo * (lo + 1)) // 2        # sum of p + 1 for p in [lo, hi)
    return batch * n_head * total


def imbalance(values):
    """(busiest - idlest, busiest / idlest) of a list of per-rank work."""
    hi, lo = max(values), min(values)
    return hi - lo, (hi / lo if lo else float("inf"))
