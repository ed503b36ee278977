"""Every legal layout of a model on a cluster, estimated, best first.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm

The space (Narayanan et al. 2021, section 3's takeaways, as rules): tp divides the heads
and the key/value heads and stays inside a node (unless given); pp is any divisor of the
GPUs left (GPUs / (tp cp)) up to the layers, its stages holding the layers as
stage_splits lists them (evenly where pp divides them, else the end stages lighter, as
Llama 3's 126 layers on 16 stages: 7, 8, ..., 8, 7); dp = GPUs / (tp pp cp) divides the
global batch with the micro-batch (1, 2, 4, 8); ZeRO stages 0-3 (only 0 when dp x cp = 1);
sequence parallelism on and off when tp > 1; recomputation none, selective or full;
interleaving with 1, 2, 4 or 8 chunks where legal (layout.legal); TP communication overlap
(Megatron-LM's --tp-comm-overlap) on and off where SP is on. Any of these can be fixed
(held at the value given while the others range). Context parallelism is not searched: cp
(and its variant) is held at what the caller gives, 1 by default (this project's choice:
CP pays only at long sequences, and a planner that tried it everywhere would multiply the
space for layouts nobody runs at 4K). Order: layouts that fit first, then by step time.
"""
from itertools import product

from minidist.plan.cost import estimate
from minidist.plan.layout import RECOMPUTE, Layout, legal, stage_layers

MICRO_BATCHES = (1, 2, 4, 8)
CHUNKS = (1, 2, 4, 8)
END_SLACK = 2     # the end stages searched hold up to this many layers fewer than the middle ones


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def stage_splits(L, p, first=None, last=None):
    """[(first, last)]: the layers on the first and last of p stages the search tries
    (Layout.first_stage_layers, last_stage_layers; (None, None) is stage_layers' default
    split, listed first where there is one). Given first and/or last: that one split, if
    it is one. Otherwise (this project's rule, what a person tries): every split whose
    middle stages hold k layers each and whose end stages hold k - END_SLACK to k each
    (ends lighter, never heavier: the first stage holds the most micro-batches in flight
    and the embedding, the last the head and the logits); with p = 2, the two stages
    within END_SLACK of half; where no split keeps the ends that close, the middle stages
    hold ceil(L/p) and the ends share the rest evenly (88 layers on 16 stages: 2-6-2),
    and none when they cannot (88 on 32). 126 layers on 16 stages: 7-8-7 (Llama 3's),
    6-8-8, 8-8-6."""
    if first is not None or last is not None:
        return [(first, last)] if stage_layers(L, p, first, last) else []
    if p == 1:
        return [(None, None)]
    if p == 2:
        lo, hi = max(1, (L + 1) // 2 - END_SLACK), min(L - 1, L // 2 + END_SLACK)
        cands = [(f, L - f) for f in range(lo, hi + 1)]
    else:
        cands, k0 = [], -(-L // p)
        for k in range(k0, (L + 2 * END_SLACK) // p + 1):
            r = L - (p - 2) * k                       # the two end stages' layers together
            lo = max(1, k - END_SLACK)
            cands += [(f, r - f) for f in range(max(lo, r - k), min(k, r - lo) + 1)]
        r = L - (p - 2) * k0
        if not cands and r >= 2:                      # ends lighter still: split them evenly
            cands = sorted({(r // 2, r - r // 2), (r - r // 2, r // 2)})
    default = stage_layers(L, p)
    out = [(None, None)] if default else []
    return out + [c for c in cands if stage_layers(L, p, *c) != default]


def layouts(model, cluster, tp=None, pp=None, micro_batch=None, chunks=None, zero=None,
            sequence_parallel=None, recompute=None, precision="megatron", flash_attention=False,
            cp=1, cp_variant="allgather", first_stage_layers=None, last_stage_layers=None,
            tp_comm_overlap=None):
    """Legal Layouts, the given fields fixed (None: searched) and the others ranging over the
    space above."""
    n = cluster.gpus // cp if cluster.gpus % cp == 0 else 0     # GPUs left for tp x pp x dp
    if n == 0:
        return
    tps = [tp] if tp else [t for t in _divisors(min(model.heads, cluster.gpus_per_node))
                           if model.heads % t == 0 and model.kv % t == 0 and n % t == 0]
    pps = [pp] if pp else [p for p in _divisors(n) if p <= model.layers]
    for t, p in product(tps, pps):
        if n % (t * p):
            continue
        d = n // (t * p)
        for (f, l), b, v, z, sp, rc, ov in product(
                stage_splits(model.layers, p, first_stage_layers, last_stage_layers),
                [micro_batch] if micro_batch else MICRO_BATCHES,
                [chunks] if chunks else CHUNKS,
                [zero] if zero is not None else ((0, 1, 2, 3) if d * cp > 1 else (0,)),
                [sequence_parallel] if sequence_parallel is not None
                else ((False, True) if t > 1 else (False,)),
                [recompute] if recompute else RECOMPUTE,
                [tp_comm_overlap] if tp_comm_overlap is not None else (False, True)):
            lay = Layout(t, p, d, b, v, z, sp, rc, precision, flash_attention, cp=cp, cp_variant=cp_variant,
                         first_stage_layers=f, last_stage_layers=l, tp_comm_overlap=ov)
            if legal(model, cluster, lay) is None:
                yield lay


def search(model, cluster, top=5, **fixed):
    """The `top` best Estimates (fitting ones first, then by step time; top=None: all of
    them); [] if no layout is legal. fixed: layouts' keywords, held."""
    ests = [estimate(model, cluster, lay) for lay in layouts(model, cluster, **fixed)]
    ests.sort(key=lambda e: (not e.fits, e.step_time_s))
    return ests if top is None else ests[:top]
