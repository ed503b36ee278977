"""Every legal layout of a model on a cluster, estimated, best first.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm

The space (Narayanan et al. 2021, section 3's takeaways, as rules): tp divides the heads
and the key/value heads and stays inside a node (unless given); pp divides the layers;
dp = GPUs / (tp pp) divides the global batch with the micro-batch; ZeRO stages 0-3
(only 0 when dp x cp = 1); sequence parallelism when tp > 1; recomputation none, selective or
full; interleaving with 1, 2, 4 or 8 chunks where legal (layout.legal). Any of these can
be fixed. Context parallelism is not searched: cp (and its variant) is held at what the
caller gives, 1 by default (this project's choice: CP pays only at long sequences, and a
planner that tried it everywhere would multiply the space for layouts nobody runs at 4K).
Order: layouts that fit first, then by step time.
"""
from itertools import product

from minidist.plan.cost import estimate
from minidist.plan.layout import RECOMPUTE, Layout, legal

MICRO_BATCHES = (1, 2, 4, 8)
CHUNKS = (1, 2, 4, 8)


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(model, cluster, tp=None, pp=None, micro_batch=None, chunks=None, zero=None,
            sequence_parallel=None, recompute=None, precision="megatron", flash_attention=False,
            cp=1, cp_variant="allgather"):
    """Legal Layouts, the given fields fixed and the others ranging over the space above."""
    n = cluster.gpus // cp if cluster.gpus % cp == 0 else 0     # GPUs left for tp x pp x dp
    if n == 0:
        return
    tps = [tp] if tp else [t for t in _divisors(min(model.heads, cluster.gpus_per_node))
                           if model.heads % t == 0 and model.kv % t == 0 and n % t == 0]
    pps = [pp] if pp else [p for p in _divisors(model.layers) if n % p == 0]
    for t, p in product(tps, pps):
        if n % (t * p):
            continue
        d = n // (t * p)
        for b, v, z, sp, rc in product([micro_batch] if micro_batch else MICRO_BATCHES,
                                       [chunks] if chunks else CHUNKS,
                                       [zero] if zero is not None else ((0, 1, 2, 3) if d * cp > 1 else (0,)),
                                       [sequence_parallel] if sequence_parallel is not None
                                       else ((False, True) if t > 1 else (False,)),
                                       [recompute] if recompute else RECOMPUTE):
            lay = Layout(t, p, d, b, v, z, sp, rc, precision, flash_attention, cp=cp, cp_variant=cp_variant)
            if legal(model, cluster, lay) is None:
                yield lay


def search(model, cluster, top=5, **fixed):
    """The `top` best Estimates (fitting ones first, then by step time; top=None: all of
    them); [] if no layout is legal."""
    ests = [estimate(model, cluster, lay) for lay in layouts(model, cluster, **fixed)]
    ests.sort(key=lambda e: (not e.fits, e.step_time_s))
    return ests if top is None else ests[:top]
