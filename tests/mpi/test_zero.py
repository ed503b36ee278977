"""ZeRO stages 1-3 and FSDP against one process, at whatever world size mpirun gives.

    mpirun -n 3 python -m pytest --only-mpi tests/mpi/test_zero.py

float64, 3 AdamW steps with clipping that clips, 2 micro-batches per rank, a parameter
count (5330) that 3, 4 and 8 do not divide. Sharded gradients and weights are compared
partition by partition: each rank's piece "NAME[a:b]" against elements a:b of the
reference's flattened NAME (zero.reference_slice), so what each rank holds is checked
without gathering anything back. Bytes sent are held to the ring's chunk-by-chunk count
exactly and to the paper's 2 Psi / 3 Psi within the chunks' rounding; memory is read from
the arrays each rank holds.
"""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ring_reduce_scatter, stats
from minidist.data import shard_slice
from minidist import equivalence
from minidist.parallel import zero as zero_module
from minidist.parallel.fsdp import Units
from minidist.parallel.zero import ZeRO, expected_sent, reference_slice
from minidist.plan.memory import engine_state_bytes
from minidist.plan.traffic import zero_bytes
from sharded_setup import ACCUM, BATCH, Setup

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 4
WHY = "the partitions (uneven at 3) and the ring are those of 3 and 4 ranks; test_3d_parallel.py runs ZeRO-1 at 8"

COMM = MPI.COMM_WORLD
N = COMM.Get_size()
SETUP = Setup(n_layer=2)
CFG, DATA, ARGS, TC = SETUP.cfg, SETUP.data, SETUP.args, SETUP.tc
fresh, reference = SETUP.fresh, SETUP.reference


def run(**kw):
    model, opt = fresh()
    units = Units(model, COMM) if kw.get("stage") == 3 else None    # stage 3: FSDP's units
    z = ZeRO(model, opt, COMM, units=units, **kw)
    rows = shard_slice(BATCH, COMM.Get_rank(), N, ACCUM)
    with stats.measure() as m:
        losses, state, _ = equivalence.train_and_collect(model, z, DATA, ARGS, TC, rows, ACCUM, z)
    ref_losses, ref_state = reference()
    state = {k: v for k, v in state.items()}
    state["loss"] = equivalence.mpi_reduce(COMM, losses, "sum") / N
    ref = {k: reference_slice(k, ref_state) for k in state if k != "loss"}
    ref["loss"] = np.array(ref_losses)
    rel, _, worst = equivalence.compare(state, ref)
    sent = {c: m.bytes_sent(c) // ARGS.steps for c in ("reduce_scatter", "all_gather", "all_reduce")}
    return SimpleNamespace(rel=equivalence.mpi_reduce(COMM, rel), worst=worst, z=z, sent=sent, model=model)


CASES = {"stage 1": dict(stage=1), "stage 2 naive": dict(stage=2, bucket_bytes=4096),
         "stage 2 overlapped": dict(stage=2, bucket_bytes=4096, overlap=True), "stage 3": dict(stage=3)}
# FSDP's choices (resharding, prefetch) and their exact peaks: tests/mpi/test_fsdp.py


@pytest.mark.parametrize("case", list(CASES))
def test_equals_one_process_and_bytes_and_memory(case):
    r = run(**CASES[case])
    assert r.rel <= 1e-10, f"{case} at {N} ranks: max_rel_diff {r.rel:.2e} (largest in {r.worst})"
    z, item = r.z, 8
    # bytes: the ring's exact count, and the paper's within one element per chunk step
    exp = expected_sent(z, ACCUM)
    assert r.sent["reduce_scatter"] == exp["reduce_scatter"] and r.sent["all_gather"] == exp["all_gather"], (r.sent, exp)
    assert r.sent["all_reduce"] == 0                     # no all-reduce anywhere: that is the point
    psi = sum(g.n for g in z.groups)
    root = z.groups[0].n if z.stage == 3 else 0
    if z.stage < 3 or z.units.reshard:
        calls = (2 * ACCUM + 1) * len(z.groups)      # collectives per step, at most
        formula = zero_bytes(z.stage, psi, N, item, ACCUM, root)
        assert abs(sum(exp.values()) - formula) <= calls * (N - 1) * item, (exp, formula)
    # memory: optimizer state 1/N of DP's within one element per group, from the arrays
    mem, want = z.memory(), engine_state_bytes(z.stage, psi, N, item)
    held = sum(g.hi - g.lo for g in z.groups)
    assert mem["optimizer"] == 2 * item * held
    assert abs(mem["optimizer"] - want["optimizer"]) <= 2 * item * len(z.groups)
    if z.stage >= 2:
        assert mem["grads"] == item * held
    else:                                                # stage 1 keeps the local gradient beside its partition
        assert mem["grads"] == item * (psi + held), (mem["grads"], item * (psi + held))
    assert abs(mem["grads"] - want["grads"]) <= item * len(z.groups), \
        f"{case}: gradients held {mem['grads']:,} B, engine_state_bytes says {want['grads']:,.0f} B"
    # the gradient peak, read from the arrays: naive holds the whole gradient (beside the
    # partition of the first micro-batch), overlapped at most two buckets' copies in flight
    full = item * psi
    if z.stage == 2 and not z.overlap:
        assert z.peak_grad_bytes == full + item * held, z.peak_grad_split
    if z.stage == 2 and z.overlap:
        largest = item * max(g.n for g in z.groups)
        assert z.peak_grad_split["in_flight"] <= z.max_in_flight * largest, z.peak_grad_split
        assert z.peak_grad_bytes < full + item * held, f"overlapped stage 2 peaked at {z.peak_grad_split}, no less than naive"
    if z.stage == 3:
        assert mem["params"] == item * held               # my shards, nothing gathered between steps
        sizes = [g.n * item for g in z.groups]
        one = sizes[0] + max(sizes[1:])
        if not z.units.reshard:
            assert z.units.peak == sum(sizes)
        elif z.units.prefetch:
            assert one <= z.units.peak <= sizes[0] + 2 * max(sizes[1:])
        else:
            assert z.units.peak == one, "stage 3 holds the root and one block gathered at a time"
        assert all(p.data.size == 0 for p in r.model.parameters()), "gathered parameters were not freed"


def test_forgetting_to_average_fails(monkeypatch):
    """A planted bug: the reduce-scatter's sum not divided by N. Only at 2 ranks and more."""
    if N == 1:
        pytest.skip("at one rank the sum is the average")
    monkeypatch.setattr(zero_module, "reduce_scatter_grad",
                        lambda comm, flat: ring_reduce_scatter(comm, flat, op="sum"))
    assert run(stage=1).rel > 1e-3


def test_unknown_stage_is_refused():
    model, opt = fresh()
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeRO(model, opt, COMM, stage=4)
