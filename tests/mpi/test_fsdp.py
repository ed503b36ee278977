"""FSDP (ZeRO stage 3 unit by unit) against one process, at whatever world size mpirun gives.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_fsdp.py

float64, 3 AdamW steps with clipping that clips, 2 micro-batches per rank, 4 blocks so a
prefetch really overlaps a unit (and one of the unit after next would show: with 3 blocks
it peaks and gathers in the same order), and unit sizes that 3, 4 and 8 do not divide. Each
rank's shards of the raw gradients and weights are compared with the same slices of the
reference's (zero.reference_slice). Every choice (reshard after forward or not, prefetch
or not) is held to: the bytes of the ring exactly, the paper's count within the chunks'
rounding, and the peak of gathered parameter bytes, read from the live arrays, exactly
equal to the rule (root + one block; root + two with a prefetch; every unit without
resharding). A unit that is never freed fails.
"""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import stats
from minidist.data import shard_slice
from minidist import equivalence
from minidist.parallel import fsdp as fsdp_module
from minidist.parallel.fsdp import FSDP
from minidist.parallel.zero import expected_sent, reference_slice
from minidist.plan.traffic import zero_bytes
from sharded_setup import ACCUM, BATCH, Setup

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "the units, partitions (uneven at 3) and the ring are those of 3 and 4 ranks"

COMM = MPI.COMM_WORLD
N = COMM.Get_size()
SETUP = Setup(n_layer=4)
CFG, DATA, ARGS, TC = SETUP.cfg, SETUP.data, SETUP.args, SETUP.tc
fresh, reference = SETUP.fresh, SETUP.reference


def run(reshard, prefetch):
    model, opt = fresh()
    f = FSDP(model, opt, COMM, reshard_after_forward=reshard, prefetch=prefetch)
    rows = shard_slice(BATCH, COMM.Get_rank(), N, ACCUM)
    with stats.measure() as m:
        losses, state, _ = equivalence.train_and_collect(model, f, DATA, ARGS, TC, rows, ACCUM, f)
    ref_losses, ref_state = reference()
    state["loss"] = equivalence.mpi_reduce(COMM, losses, "sum") / N
    ref = {k: reference_slice(k, ref_state) for k in state if k != "loss"}
    ref["loss"] = np.array(ref_losses)
    rel, _, worst = equivalence.compare(state, ref)
    sent = {c: m.bytes_sent(c) // ARGS.steps for c in ("reduce_scatter", "all_gather", "all_reduce")}
    return SimpleNamespace(rel=equivalence.mpi_reduce(COMM, rel), worst=worst, f=f, sent=sent, model=model)


CHOICES = [(True, False), (True, True), (False, False), (False, True)]


@pytest.mark.parametrize("reshard, prefetch", CHOICES, ids=lambda v: str(v))
def test_fsdp_equals_one_process_with_exact_bytes_and_peak(reshard, prefetch):
    r = run(reshard, prefetch)
    what = f"FSDP reshard={reshard} prefetch={prefetch} at {N} ranks"
    assert r.rel <= 1e-10, f"{what}: max_rel_diff {r.rel:.2e} (largest in {r.worst})"
    units, item = r.f.units, 8
    exp = expected_sent(r.f, ACCUM)
    assert (r.sent["reduce_scatter"], r.sent["all_gather"]) == (exp["reduce_scatter"], exp["all_gather"]), (r.sent, exp)
    assert r.sent["all_reduce"] == 0
    psi, root = sum(g.n for g in units.groups), units.groups[0].n
    formula = zero_bytes(3, psi, N, item, ACCUM, root, reshard)
    calls = 3 * ACCUM * len(units.groups)
    assert abs(sum(exp.values()) - formula) <= calls * (N - 1) * item, (exp, formula)
    # parameter memory: exactly the rule, read from the gathered buffers
    sizes = [g.n * item for g in units.groups]
    if not reshard:
        rule = sum(sizes)
    else:
        rule = sizes[0] + (2 if prefetch else 1) * max(sizes[1:])
    assert units.peak == rule, f"{what}: gathered peak {units.peak:,} B, the rule {rule:,} B"
    assert all(p.data.size == 0 for p in r.model.parameters()), "gathered parameters were not freed"
    assert r.f.memory()["params"] == item * sum(g.hi - g.lo for g in units.groups)


def test_the_units_timeline_goes_down_then_up():
    """Forward gathers the root and blocks 1..L in order; backward gathers (or waits for) the
    blocks from L down, and reduce-scatters each before the one below it. Each prefetch
    brings the next unit: unit u+1 as forward reaches u, u-1 as backward does (never the
    root, gathered at the start and kept)."""
    r = run(True, True)
    events, units = r.f.units.events, len(r.f.units.groups)
    start = max(i for i, e in enumerate(events) if e[0] == 0 and e[1] == "gather")
    last = events[start:]
    fwd = [u for u, what, _, _ in last if what in ("gather", "wait")][:units]
    reduced = [u for u, what, _, _ in last if what == "reduce-scatter"]
    assert fwd == list(range(units)), last
    assert reduced == list(range(units - 1, -1, -1)), reduced
    fetched = [(prev, u) for prev, (u, what, _, _) in zip(last, last[1:]) if what == "prefetch"]
    want = [(u - 1, u) for u in range(2, units)] + [(u + 1, u) for u in range(units - 2, 0, -1)]
    assert [(p[0], u) for p, u in fetched] == want, \
        f"(unit gathered, unit it prefetched): {[(p[0], u) for p, u in fetched]}, want {want}"


def test_a_unit_never_freed_fails(monkeypatch):
    """A planted bug: free_params does nothing. The peak, read from what the parameters
    point at, goes over the rule, and the parameters are still there after the step."""
    monkeypatch.setattr(fsdp_module, "free_params", lambda group: None)
    r = run(True, False)
    sizes = [g.n * 8 for g in r.f.units.groups]
    assert r.f.units.peak > sizes[0] + max(sizes[1:])
    assert any(p.data.size for p in r.model.parameters())
