"""Compressed data parallelism (minidist/parallel/compression.py) at whatever world size
mpirun gives (1, 2, 3, 4; UP_TO_RANKS skips 8, where it passes in 10 s).

    mpirun -n 3 python -m pytest -q --only-mpi tests/mpi/test_compression.py

Parameters are plain objects with .data / .grad (float64, 35 numbers: a length no
world size here divides, and chunks that are not multiples of 8); every rank draws
every rank's gradients from one seed, so the true average needs no communication.
Checked every step:
- bytes: `last_sent` (measured) == `bytes_formula()` for every compressor, in the
  warm-up and after, with and without buckets, with one scale per segment (a chunk cut
  at the parameter boundaries) or per chunk; the run's total == run_formula(steps); the
  formula == the module text's, a scale and a payload per segment, counted here anew;
  a model smaller than the world (empty chunks) too;
- "none": the exact average; fp16 and int8: the error within the formula's bound (int8:
  each segment's own scales);
- 1-bit and PowerSGD: error feedback loses nothing: the running sum of the applied
  gradients == the running sum of the true averages minus the residual still held
  (the ranks' mean worker residual, plus 1-bit's server residuals), to 1e-12;
- PowerSGD at full rank == the exact average; the batched PowerSGD == powersgd_step;
- every rank applies the same bits; state_dict() resumes a run bit for bit.
And a real GPT through train_step: PowerSGD at full rank and a 1-bit warm-up step give
the raw gradients NaiveDataParallel gives; compressed steps keep the replicas identical.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.comm import chunk_bounds
from minidist.parallel import compression
from minidist.parallel.compression import CompressedDataParallel

pytestmark = pytest.mark.mpi
UP_TO_RANKS = 3
WHY = "every rank does the same as the others; it passes at 8 too, but takes 10 s there on two cores"

SHAPES = [(5, 3), (7,), (2, 3, 2), (1,)]      # 35 numbers; matrices 5 x 3 and 2 x 6
N_ALL = sum(int(np.prod(s)) for s in SHAPES)
STEPS = 5


class Fake:
    """A model-like object: named parameters with .data and .grad."""

    def __init__(self, shapes=SHAPES):
        self.ps = [SimpleNamespace(data=np.zeros(s), grad=None) for s in shapes]

    def parameters(self):
        return list(self.ps)

    def named_parameters(self):
        return [(f"p{i}", p) for i, p in enumerate(self.ps)]


def all_grads(size, step, shapes=SHAPES, seed=0):
    """grads[r]: rank r's gradients at `step` (an offset so signs are not balanced)."""
    return [[np.random.default_rng([seed, r, step, i]).standard_normal(s) + 0.3 * (i - 1)
             for i, s in enumerate(shapes)] for r in range(size)]


def segments(lo, hi, size, shapes=SHAPES, scales="tensor"):
    """Bucket [lo, hi)'s chunks cut into segments, counted anew: [[(start, end) flat], per chunk]."""
    starts = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    b, out = chunk_bounds(hi - lo, size), []
    for j in range(size):
        a, e = lo + b[j], lo + b[j + 1]
        cuts = sorted({a, e} | {int(c) for c in starts if a < c < e}) if scales == "tensor" else [a, e]
        out.append([(s, t) for s, t in zip(cuts[:-1], cuts[1:]) if t > s or scales == "chunk"])
    return out


def expected_bytes(dp, size, rank, shapes=SHAPES):
    """The module text's formula for int8 / 1bit after the warm-up: per chunk, the sum over its
    segments of (itemsize + payload); send all but my own, then all but my right neighbour's."""
    if size == 1:
        return 0
    total = 0
    for lo, hi in dp.buckets:
        msg = [sum(8 + ((t - s) if dp.compressor == "int8" else -(-(t - s) // 8)) for s, t in chunk)
               for chunk in segments(lo, hi, size, shapes, dp.scales)]
        total += 2 * sum(msg) - msg[rank] - msg[(rank + 1) % size]
    return total


def flat(arrays):
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])


def step(dp, model, comm, k, shapes=SHAPES, seed=0, grads=None):
    """Give every parameter this rank's gradient of step k, sync; (applied, true average), flat."""
    grads = grads or all_grads(comm.Get_size(), k, shapes, seed)
    for p, g in zip(model.ps, grads[comm.Get_rank()]):
        p.grad = g.copy()
    formula = dp.bytes_formula()
    dp.sync()
    assert dp.last_sent == formula, \
        f"rank {comm.Get_rank()}, step {k}: {dp.last_sent} bytes sent, formula {formula}"
    applied = flat(p.grad for p in model.ps)
    same = comm.allgather(applied)
    assert all(np.array_equal(a, applied) for a in same), "the ranks applied different gradients"
    return applied, flat(np.mean([flat(g) for g in grads], axis=0).reshape(1, -1))


def held_residual(dp, comm):
    """What error feedback still holds, flat: the ranks' mean worker residual plus the
    server residuals of every chunk (1-bit), or the mean PowerSGD error (matrices)."""
    size, d = comm.Get_size(), dp.state_dict()
    if dp.compressor == "powersgd":
        mine = flat(d[f"powersgd.error.p{i}"] if f"powersgd.error.p{i}" in d else np.zeros(p.data.shape)
                    for i, p in enumerate(dp.params))
        return np.mean(comm.allgather(mine), axis=0)
    held = np.mean(comm.allgather(d["onebit.worker_error"]), axis=0)
    servers, at = comm.allgather(d["onebit.server_error"]), [0] * size
    for lo, hi in dp.buckets:             # chunk j of each bucket is rank j's next piece
        b = chunk_bounds(hi - lo, size)
        for j in range(size):
            length = b[j + 1] - b[j]
            held[lo + b[j]:lo + b[j + 1]] += servers[j][at[j]:at[j] + length]
            at[j] += length
    return held


@pytest.mark.parametrize("compressor,bucket,scales", [
    ("none", None, "tensor"), ("fp16", None, "tensor"), ("fp16", 80, "tensor"), ("int8", None, "tensor"),
    ("int8", 80, "tensor"), ("int8", None, "chunk"), ("1bit", None, "tensor"), ("1bit", 80, "tensor"),
    ("1bit", None, "chunk"), ("powersgd", None, "tensor")])
def test_bytes_measured_equal_the_formula(comm, compressor, bucket, scales):
    """Warm-up (2 steps) then compressed; buckets of 80 bytes = 10 numbers (35 = 10+10+10+5)."""
    model = Fake()
    dp = CompressedDataParallel(model, comm, compressor, rank=2, warmup_steps=2, bucket_bytes=bucket,
                                scales=scales)
    total = 0
    for k in range(4):
        step(dp, model, comm, k)
        total += dp.last_sent
    assert total == dp.run_formula(4)
    assert dp.steps == 4
    if compressor in ("int8", "1bit"):
        want = expected_bytes(dp, comm.Get_size(), comm.Get_rank())
        assert dp.compressed_bytes() == want, f"formula {dp.compressed_bytes()}, the module text's {want}"
    # rank 2 of a 5 x 3 matrix saves nothing, nor do 1-number chunks with an 8-byte scale each
    if comm.Get_size() > 1 and compressor not in ("none", "powersgd") and bucket is None:
        assert dp.compressed_bytes() < dp.uncompressed_bytes()


def test_none_is_the_exact_average(comm):
    model = Fake()
    dp = CompressedDataParallel(model, comm, "none")
    for k in range(2):
        applied, true = step(dp, model, comm, k)
        assert np.max(np.abs(applied - true)) <= 1e-14 * np.max(np.abs(true))


def test_fp16_error_within_its_bound(comm):
    """Each rank's g/N rounds to float16 (relative error u = 2^-11), then N-1 float16 additions
    each round a partial sum: |error| <= (N+1) u sum_i |g_i| / N (+ float16's subnormal step)."""
    size, model = comm.Get_size(), Fake()
    dp = CompressedDataParallel(model, comm, "fp16")
    for k in range(2):
        applied, true = step(dp, model, comm, k)
        mean_abs = np.mean([np.abs(flat(g)) for g in all_grads(size, k)], axis=0)
        bound = (size + 1) * 2.0**-11 * mean_abs * 1.001 + size * 2.0**-25
        assert np.all(np.abs(applied - true) <= bound), f"fp16 error {np.max(np.abs(applied - true)):.2e}"


@pytest.mark.parametrize("bucket,scales", [(None, "tensor"), (80, "tensor"), (None, "chunk")])
def test_int8_error_within_its_bound(comm, bucket, scales):
    """Phase 1: each piece is off by at most its scale / 2 (scale = max|segment| / 127), so
    the mean by the mean of those; phase 2 adds half the averaged segment's scale, which is
    max|applied segment| / 127 (its largest code is 127). A segment: a chunk's piece of one
    parameter ("tensor"), or the whole chunk ("chunk")."""
    size, model = comm.Get_size(), Fake()
    dp = CompressedDataParallel(model, comm, "int8", bucket_bytes=bucket, scales=scales)
    for k in range(3):
        applied, true = step(dp, model, comm, k)
        grads = [flat(g) for g in all_grads(size, k)]
        bound = np.zeros(N_ALL)
        for lo, hi in dp.buckets:
            for chunk in segments(lo, hi, size, scales=scales):
                for a, e in chunk:
                    if e == a:
                        continue
                    s = slice(a, e)
                    phase1 = np.mean([np.max(np.abs(g[s])) / 127 / 2 for g in grads])
                    bound[s] = phase1 + np.max(np.abs(applied[s])) / 127 / 2
        err = np.abs(applied - true)
        assert np.all(err <= bound * (1 + 1e-9) + 1e-15), f"int8 error {np.max(err - bound):.2e} above the bound"


@pytest.mark.parametrize("compressor,warmup,bucket,rank,scales", [
    ("1bit", 0, None, 0, "tensor"), ("1bit", 2, None, 0, "tensor"), ("1bit", 0, 80, 0, "tensor"),
    ("1bit", 0, None, 0, "chunk"), ("powersgd", 0, None, 1, "tensor"), ("powersgd", 2, None, 2, "tensor")])
def test_error_feedback_loses_nothing(comm, compressor, warmup, bucket, rank, scales):
    """sum of applied == sum of true averages - residual held, every step, to 1e-12."""
    model = Fake()
    dp = CompressedDataParallel(model, comm, compressor, rank=max(rank, 1), warmup_steps=warmup,
                                bucket_bytes=bucket, scales=scales)
    applied_sum, true_sum = np.zeros(N_ALL), np.zeros(N_ALL)
    for k in range(STEPS):
        applied, true = step(dp, model, comm, k)
        applied_sum += applied
        true_sum += true
        gap = np.abs(applied_sum - (true_sum - held_residual(dp, comm)))
        rel = np.max(gap) / np.max(np.abs(true_sum))
        assert rel <= 1e-12, f"step {k}: sum of applied misses the true sum minus the residual by {rel:.1e}"
        if k < warmup:
            assert np.max(np.abs(applied - true)) <= 1e-14 * np.max(np.abs(true)), "warm-up must be exact"
    assert np.max(np.abs(held_residual(dp, comm))) > 0, "compression lost nothing at all: was it applied?"


def test_powersgd_at_full_rank_is_the_exact_average(comm):
    """Full rank (3 for 5 x 3, 2 for 2 x 6): P spans M's columns, P P^T M == M. Float64 with
    Gram-Schmidt run twice keeps P orthonormal to ~1e-15; 1e-10 leaves room for the
    conditioning of M Q (a random Q)."""
    model = Fake()
    dp = CompressedDataParallel(model, comm, "powersgd", rank=3)
    for k in range(STEPS):
        applied, true = step(dp, model, comm, k)
        rel = np.max(np.abs(applied - true)) / np.max(np.abs(true))
        assert rel <= 1e-10, f"step {k}: full-rank PowerSGD is off the average by {rel:.1e}"


def test_powersgd_full_rank_after_a_rank_deficient_step(comm):
    """Step 0's summed gradient has rank 1 (as a matrix fed by a layer norm is rank-deficient):
    3 of P's 4 columns are zeroed and so are Q's; redrawn, full rank is exact again at step 1."""
    size, model = comm.Get_size(), Fake([(6, 4)])
    dp = CompressedDataParallel(model, comm, "powersgd", rank=4)
    u, v = np.arange(1.0, 7.0), np.array([1.0, -2.0, 0.5, 3.0])
    rank_one = [[(r + 1) * np.outer(u, v)] for r in range(size)]
    for k in range(3):
        grads = rank_one if k == 0 else all_grads(size, k, [(6, 4)])
        applied, true = step(dp, model, comm, k, [(6, 4)], grads=grads)
        rel = np.max(np.abs(applied - true)) / np.max(np.abs(true))
        assert rel <= 1e-10, f"step {k}: full-rank PowerSGD is off the average by {rel:.1e}"
        assert np.all(np.any(dp.state_dict()["powersgd.Q.p0"], axis=0)), "a column of Q stayed zero"


def test_powersgd_batched_equals_powersgd_step(comm):
    """One matrix, rank 2: the synchroniser's first step == compression.powersgd_step with its Q."""
    model = Fake([(6, 4)])
    dp = CompressedDataParallel(model, comm, "powersgd", rank=2, seed=3)
    Q0 = dp.state_dict()["powersgd.Q.p0"]
    M = all_grads(comm.Get_size(), 0, [(6, 4)])[comm.Get_rank()][0]
    approx, Q1 = compression.powersgd_step(comm, M, Q0)
    applied, _ = step(dp, model, comm, 0, [(6, 4)])
    assert np.allclose(applied, approx.reshape(-1), rtol=0, atol=1e-13)
    assert np.allclose(dp.state_dict()["powersgd.Q.p0"], Q1, rtol=0, atol=1e-13)


@pytest.mark.parametrize("compressor", ["int8", "1bit"])
def test_a_model_smaller_than_the_world(comm, compressor):
    """3 numbers (2 + 1) on up to 4 ranks: some chunks are empty, have no segment and send
    nothing; the bytes still equal the formula, error feedback still loses nothing."""
    shapes = [(2,), (1,)]
    model = Fake(shapes)
    dp = CompressedDataParallel(model, comm, compressor, scales="tensor")
    applied_sum, true_sum = np.zeros(3), np.zeros(3)
    for k in range(3):
        applied, true = step(dp, model, comm, k, shapes)
        assert dp.compressed_bytes() == expected_bytes(dp, comm.Get_size(), comm.Get_rank(), shapes)
        applied_sum += applied
        true_sum += true
        if compressor == "1bit":
            gap = np.abs(applied_sum - (true_sum - held_residual(dp, comm)))
            assert np.max(gap) <= 1e-12 * np.max(np.abs(true_sum))
        else:
            assert np.max(np.abs(applied - true)) <= np.max(np.abs(true)) / 127 * 2


@pytest.mark.parametrize("compressor", ["1bit", "powersgd"])
def test_state_dict_resumes_bit_for_bit(comm, compressor):
    def run(steps, start=None):
        model = Fake()
        dp = CompressedDataParallel(model, comm, compressor, rank=2, warmup_steps=1)
        if start is not None:
            dp.load_state_dict(start)
        out = [step(dp, model, comm, k)[0] for k in range(dp.steps, steps)]
        return out, dp.state_dict()
    straight, _ = run(4)
    _, saved = run(2)
    resumed, _ = run(4, saved)
    assert all(np.array_equal(a, b) for a, b in zip(straight[2:], resumed))
    with pytest.raises(ValueError):
        CompressedDataParallel(Fake(), comm, compressor, rank=2).load_state_dict({"steps": np.array(1)})


# ----------------------------------------------------------------------------- a real GPT, train_step

def gpt_run(comm, make_dp, steps=3):
    from minidist.data import Dataset, default_corpus, shard_slice
    from minidist import equivalence
    from minidist.model import GPT, GPTConfig
    from minidist.parallel.data_parallel import replica_checksums
    from minidist.train import TrainConfig
    cfg = GPTConfig(block_size=8, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dtype="float64")
    data = Dataset.from_text(default_corpus()[:20_000], block_size=8, seed=5)
    batch = 24
    tc = TrainConfig(batch_size=batch, max_iters=steps, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
    model = GPT(cfg, seed=11)
    opt = model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))
    dp = make_dp(model)
    rows = shard_slice(batch, comm.Get_rank(), comm.Get_size(), 1)
    args = SimpleNamespace(steps=steps, batch_size=batch, seed=7)
    losses, state, _ = equivalence.train_and_collect(model, opt, data, args, tc, rows, 1, dp)
    crcs = replica_checksums(model, comm)
    assert len(set(crcs)) == 1, "the replicas' weights differ"
    return losses, state, dp


def test_gpt_train_step(comm):
    from minidist.equivalence import compare
    from minidist.parallel.data_parallel import NaiveDataParallel
    _, naive, _ = gpt_run(comm, lambda m: NaiveDataParallel(m, comm))
    full = lambda m: CompressedDataParallel(m, comm, "powersgd", rank=16)   # n_embd: every matrix at full rank
    _, power, dp = gpt_run(comm, full)
    assert dp.steps == 3
    rel, _, worst = compare(power, naive)
    assert rel <= 1e-10, f"full-rank PowerSGD through train_step: {worst} off by {rel:.1e}"
    losses, onebit, dp = gpt_run(comm, lambda m: CompressedDataParallel(m, comm, "1bit", warmup_steps=1))
    first = {k: v for k, v in naive.items() if k.endswith("@step0")}
    rel, _, worst = compare({k: onebit[k] for k in first}, first)
    assert rel <= 1e-12, f"1-bit's warm-up step: {worst} off by {rel:.1e}"
    assert np.all(np.isfinite(losses))
    if comm.Get_size() > 1:
        assert dp.last_sent * 20 < dp.uncompressed_bytes()


# ----------------------------------------------------------------------------- 1-bit Adam, compressed steps

def test_one_bit_adam_averages_the_momenta_and_keeps_the_replicas_equal(comm):
    """OneBitAdam after its warm-up, on the job's ranks (each its own gradients): every
    rank's momentum is compressed_allreduce of the ranks' own momenta, rebuilt here from
    AdamW's state before the step (with copies of the residuals); the weights take AdamW's
    update with that momentum and v frozen, and are bit for bit the same on every rank."""
    from minidist.nn import Parameter
    from minidist.optim import AdamW
    size, rank = comm.Get_size(), comm.Get_rank()
    start = [np.random.default_rng([9, i]).standard_normal(s) for i, s in enumerate(SHAPES)]
    model = Fake()
    model.ps = [Parameter(a.copy()) for a in start]
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.1
    inner = AdamW(model.ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    dp = CompressedDataParallel(model, comm, "1bit-adam", warmup_steps=1)
    opt = compression.OneBitAdam(inner, dp)
    for k in range(4):
        for p, g in zip(model.ps, all_grads(size, k)[rank]):
            p.grad = g
        dp.sync()
        if not dp.compressing:
            opt.step()
            continue
        before = [(p.data.copy(), inner.state[id(p)]["exp_avg"].copy()) for p in model.ps]
        local = flat(b1 * m + (1 - b1) * p.grad for p, (_, m) in zip(model.ps, before))
        worker, server = dp.worker_error.copy(), dp.server_error[0].copy()
        want = local if size == 1 else compression.compressed_allreduce(comm, local, worker, server)
        opt.step()
        got = flat(inner.state[id(p)]["exp_avg"] for p in model.ps)
        assert np.array_equal(got, want), f"rank {rank}, step {k}: the momentum is not the 1-bit average"
        assert np.array_equal(dp.worker_error, worker) and np.array_equal(dp.server_error[0], server)
        if size > 1:
            assert not np.array_equal(got, local), "the momentum was not averaged"
        at = 0
        for p, (data, _) in zip(model.ps, before):
            s, m = inner.state[id(p)], want[at:at + p.data.size].reshape(p.data.shape)
            at += p.data.size
            denom = np.sqrt(s["exp_avg_sq"]) / np.sqrt(1 - b2 ** s["v_step"]) + eps
            update = data * (1 - lr * wd) - lr / (1 - b1 ** s["step"]) * m / denom
            assert s["v_step"] == 1 and np.max(np.abs(p.data - update)) <= 1e-12 * np.max(np.abs(data))
        weights = flat(p.data for p in model.ps)
        every = np.empty((size, weights.size))
        comm.Allgather(weights, every)
        assert all(np.array_equal(every[0], w) for w in every), "the replicas' weights differ"
