"""Tensor parallelism's serial parts: how weights are cut and put back, the padding of the
vocabulary, the bytes formulas against the ring's schedule, and the one-rank model.

    python -m pytest -q tests/test_tensor_parallel_serial.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from minidist import ops
from minidist.comm import chunk_bounds
from minidist.model import GPT, GPTConfig
from minidist.parallel import tensor_parallel as tpm, tp_model
from minidist.parallel.tensor_parallel import padded_vocab, vocab_range
from minidist.plan.collectives import ring_all_gather_sent, ring_all_reduce_sent, ring_reduce_scatter_sent
from minidist.parallel.tp_model import (Shard, TensorParallelGPT, TPError, check_sharded, shard, shard_specs,
                                        unshard)
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun


class FakeComm:
    """Enough of a communicator to build (not run) rank `rank` of a t-way model."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank


CFG = dict(block_size=8, vocab_size=250, n_layer=2, n_head=24, n_embd=48, dtype="float64")

# ----------------------------------------------------------------------------- cutting and gathering


CUTS = {   # name: (spec for t ranks, whole shape)
    "row-parallel weight": (lambda t: Shard(0), (192, 48)),
    "column-parallel weight": (lambda t: Shard(1), (48, 192)),
    "c_attn weight (q|k|v)": (lambda t: Shard(1, blocks=3), (48, 144)),
    "c_attn bias (q|k|v)": (lambda t: Shard(0, blocks=3), (144,)),
    "token table (padded)": (lambda t: Shard(0, size=250, padded=padded_vocab(250, t)), (250, 48)),
}


@pytest.mark.parametrize("t", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("what", sorted(CUTS))
def test_shards_put_back_give_the_whole(what, t):
    make, shape = CUTS[what]
    spec = make(t)
    full = np.random.default_rng(0).standard_normal(shape)
    pieces = [shard(full, spec, r, t) for r in range(t)]
    assert all(p.shape == tp_model.shard_shape(full.shape, spec, t) for p in pieces), f"{what}: shard shapes"
    assert np.array_equal(unshard(pieces, spec), full), f"{what} at t={t}: gathering changed the array"


@pytest.mark.parametrize("t", [1, 2, 3, 4, 8])
def test_c_attn_columns_hold_whole_heads_of_q_k_and_v(t):
    """Label every column of c_attn (C, 3C) by (block, head); rank r must get its heads of
    q, of k and of v, in that order."""
    C, nh = 48, 24
    hs = C // nh
    label = np.array([[b * 1000 + (c // hs) for b in range(3) for c in range(C)]], float)   # (1, 3C)
    for r in range(t):
        mine = shard(label, Shard(1, blocks=3), r, t)[0]
        heads = range(r * nh // t, (r + 1) * nh // t)
        want = [b * 1000 + h for b in range(3) for h in heads for _ in range(hs)]
        assert mine.tolist() == want, f"rank {r} of {t} holds columns {mine.tolist()[:8]}..., not its heads"


@pytest.mark.parametrize("V,t,padded", [(256, 8, 256), (250, 3, 252), (250, 8, 256), (5, 4, 8), (7, 1, 7)])
def test_vocabulary_padding(V, t, padded):
    assert padded_vocab(V, t) == padded
    ranges = [vocab_range(V, t, r) for r in range(t)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    spec = Shard(0, size=V, padded=padded)
    table = np.arange(V * 2, dtype=float).reshape(V, 2) + 1
    pieces = [shard(table, spec, r, t) for r in range(t)]
    stacked = np.concatenate(pieces)
    assert np.all(stacked[V:] == 0), "padded rows must be zero"
    assert np.array_equal(unshard(pieces, spec), table), "gathering must remove the padding"


def test_specs_cover_exactly_the_matrices_and_the_token_table():
    model = GPT(GPTConfig(**CFG), seed=0)
    specs = shard_specs(model.config, 4)
    names = [n for n, _ in model.named_parameters()]
    assert set(specs) <= set(names)
    replicated = sorted(set(names) - set(specs))
    assert all(n.endswith(("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight",
                           "ln_f.bias", "c_proj.bias", "wpe.weight")) for n in replicated), replicated


@pytest.mark.parametrize("t,rank", [(2, 0), (3, 2), (8, 5)])
def test_every_rank_builds_its_shards(t, rank):
    full = GPT(GPTConfig(**CFG), seed=3)
    whole = {n: p.data.copy() for n, p in full.named_parameters()}
    model = TensorParallelGPT(full, FakeComm(t, rank))
    for name, p in model.named_parameters():
        spec = model.specs.get(name)
        assert np.array_equal(p.data, shard(whole[name], spec, rank, t)), f"{name} on rank {rank} of {t}"


def test_a_parameter_left_whole_is_an_error():
    model = TensorParallelGPT(GPT(GPTConfig(**CFG), seed=0), FakeComm(4, 1))
    whole = GPT(GPTConfig(**CFG), seed=0)
    model.transformer.h[1].mlp.c_fc.weight = whole.transformer.h[1].mlp.c_fc.weight
    with pytest.raises(TPError, match="mlp.c_fc.weight"):
        check_sharded(model)
    del model.transformer.h[1].mlp.c_fc.weight
    with pytest.raises(TPError, match="missing"):
        check_sharded(model)


def test_heads_must_divide():
    with pytest.raises(TPError, match="n_head"):
        TensorParallelGPT(GPT(GPTConfig(**{**CFG, "n_head": 6}), seed=0), FakeComm(4, 0))

# ----------------------------------------------------------------------------- bytes formulas


def ring_schedule_sent(lengths, rank, phases):
    """Elements `rank` sends, walking the ring's schedule step by step (collectives.py)."""
    size, sent = len(lengths), 0
    for step in range(size - 1):
        if "rs" in phases:
            sent += lengths[(rank - step - 1) % size]
        if "ag" in phases:
            sent += lengths[(rank - step) % size]
    return sent


@pytest.mark.parametrize("n", [1, 5, 24, 100, 384])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_bytes_formulas_follow_the_ring(n, size):
    b = chunk_bounds(n, size)
    lengths = [b[c + 1] - b[c] for c in range(size)]
    for r in range(size):
        assert ring_all_reduce_sent(n, size, r) == ring_schedule_sent(lengths, r, ("rs", "ag"))
        assert ring_reduce_scatter_sent(n, 3, size, r) == 3 * ring_schedule_sent(lengths, r, ("rs",))
        assert ring_all_gather_sent(n, 3, size, r) == 3 * ring_schedule_sent(lengths, r, ("ag",))
        if n % size == 0:
            assert ring_all_reduce_sent(n, size, r) == 2 * (size - 1) * n // size   # docs/reference.md#tensor-parallelism

# ----------------------------------------------------------------------------- pieces on one rank


def test_vocab_parallel_cross_entropy_with_padding_equals_the_plain_one():
    """One rank owning a padded vocabulary of 7 for 5 real words: the loss and gradient of
    the 5 real columns equal the plain cross-entropy's; the padded columns get none."""
    g = np.random.default_rng(0)
    logits = g.standard_normal((2, 3, 7))
    targets = g.integers(0, 5, (2, 3))
    a = Tensor(logits.copy(), requires_grad=True)
    loss = tpm.vocab_parallel_cross_entropy(a, targets, 0, 5, MPI.COMM_SELF)
    loss.backward()
    b = Tensor(logits[..., :5].copy(), requires_grad=True)
    want = ops.cross_entropy(b, targets)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-15 * abs(want.item())
    assert np.allclose(a.grad[..., :5], b.grad, rtol=1e-14, atol=1e-17)
    assert np.all(a.grad[..., 5:] == 0), "padded columns must get no gradient"


def test_embedding_rows_of_other_ranks_are_zero():
    table = np.arange(12, dtype=float).reshape(4, 3) + 1        # this rank's rows 8..11
    idx = np.array([[8, 3, 11], [12, 9, 0]])
    w = Tensor(table, requires_grad=True)
    out = tpm.vocab_parallel_embedding(idx, w, lo=8)
    want = np.array([[table[0], 0 * table[0], table[3]], [0 * table[0], table[1], 0 * table[0]]])
    assert np.array_equal(out.data, want)
    out.sum().backward()
    assert w.grad.tolist() == [[1] * 3, [1] * 3, [0] * 3, [1] * 3], "ids of other ranks must leave no gradient"


def test_sliced_rng_gives_the_single_process_mask_cut():
    whole = DropoutRNG(1, 2, [4, 5]).mask((2, 6, 3, 3), 0.3, np.float64)
    cut = tpm.SlicedRNG(DropoutRNG(1, 2, [4, 5]), (2, 6, 3, 3), (slice(None), slice(2, 4)))
    assert np.array_equal(cut.mask((2, 2, 3, 3), 0.3, np.float64), whole[:, 2:4])


@pytest.mark.parametrize("sp", [False, True])
def test_one_rank_model_equals_the_gpt(sp):
    cfg = GPTConfig(**{**CFG, "dropout": 0.1})
    ref, tp = GPT(cfg, seed=2), TensorParallelGPT(GPT(cfg, seed=2), MPI.COMM_SELF, sequence_parallel=sp)
    g = np.random.default_rng(1)
    x, y = g.integers(0, 250, (3, 8)), g.integers(0, 250, (3, 8))
    l0 = ref(x, y, rng=DropoutRNG(0, 0, range(3)))[1]
    l1 = tp(x, y, rng=DropoutRNG(0, 0, range(3)))[1]
    l0.backward()
    l1.backward()
    assert abs(l0.item() - l1.item()) <= 1e-14
    grads = dict((n, p.grad) for n, p in tp.named_parameters())
    for n, p in ref.named_parameters():
        assert np.allclose(grads[n], p.grad, rtol=0, atol=1e-14 * np.abs(p.grad).max()), n

# ----------------------------------------------------------------------------- lesson 03 from outside

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def lesson03(n, *flags):
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", "minidist.lessons.03_tensor_parallel",
                           *flags], capture_output=True, text=True, timeout=120, env=ENV)


@needs_mpirun
@pytest.mark.parametrize("flags", [["--tp", "2"], ["--sequence-parallel", "--dropout", "0.1"]], ids=" ".join)
def test_lesson_03_matches_and_reports(flags, tmp_path):
    out = tmp_path / "out.json"
    proc = lesson03(4, "--n-layer", "1", "--block-size", "8", "--batch-size", "4", *flags, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["match"] is True and rep["max_rel_diff"] <= 1e-10
    assert rep["comm"]["bytes_sent"] == rep["comm"]["expected_bytes"] and rep["comm"]["bytes_sent"]


@needs_mpirun
def test_lesson_03_refuses_heads_that_do_not_divide():
    proc = lesson03(3)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert text.count("--n-head 8 is not divisible by the tensor-parallel size 3") == 1, text

# ----------------------------------------------------------------------------- activation formulas


def test_korthikanti_formulas_by_hand():
    """The paper's per-layer bytes at GPT-3's s=2048, h=12288, a=96, b=1, t=8, worked by hand."""
    from minidist.plan.memory import korthikanti_layer_bytes
    sbh, as2b = 2048 * 12288, 96 * 2048 * 2048
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 34 * sbh + 5 * as2b == 2_868_903_936
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 8) == 10 * sbh + 3 * sbh + 5 * as2b / 8
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 8, sequence_parallel=True) == (34 * sbh + 5 * as2b) / 8


def test_engine_count_splits_as_the_paper_does():
    """This engine's elements per layer: 18 sbh + 2 sb + 2 as^2b with dropout in one process;
    6 sbh + 12 sbh/t (+ the rest) under TP, as the paper's 10 sbh + 24 sbh/t is split; all of it
    over t under TP + SP."""
    from minidist.plan.memory import engine_layer_elements
    b, s, h, a, t = 2, 8, 48, 24, 4
    sbh, sb, as2b = s * b * h, s * b, a * s * s * b
    assert sum(engine_layer_elements(b, s, h, a).values()) == 18 * sbh + 2 * sb + 2 * as2b
    assert sum(engine_layer_elements(b, s, h, a, dropout=False).values()) == 16 * sbh + 2 * sb + as2b
    assert sum(engine_layer_elements(b, s, h, a, t=t).values()) == 6 * sbh + 12 * sbh // t + 2 * sb + 2 * as2b // t
    # sequence parallelism, Megatron's way (c_attn and c_fc keep the slice): the whole layer over t
    assert sum(engine_layer_elements(b, s, h, a, t=t, s_r=s // t).values()) == \
        (18 * sbh + 2 * sb + 2 * as2b) // t
    # --sp-keep-gathered: c_attn's and c_fc's inputs stay whole, 2 sbh of them
    assert sum(engine_layer_elements(b, s, h, a, t=t, s_r=s // t, regather=False).values()) == \
        2 * sbh + 16 * sbh // t + 2 * sb // t + 2 * as2b // t


@needs_mpirun
def test_lesson_03_generates_the_same_tokens(tmp_path):
    out = tmp_path / "out.json"
    proc = lesson03(2, "--n-layer", "1", "--block-size", "8", "--batch-size", "2", "--steps", "1",
                    "--generate", "12", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    fig = json.loads(out.read_text())["figures"]
    assert fig["generate_same_tokens"] == 1.0 and fig["generate_logits_max_rel_diff"] <= 1e-12
    assert fig["generate_bytes_sent"] == fig["generate_bytes_formula"] > 0
    assert fig["generate_tokens_per_s_1_process"] > 0 and fig["generate_tokens_per_s_tp"] > 0
    assert "same tokens: yes" in proc.stdout and "tokens/s" in proc.stdout
    assert fig["activation_bytes_layer_tp2_SP_measured"] == fig["activation_bytes_layer_tp2_SP_engine_count"]


@needs_mpirun
@pytest.mark.parametrize("n,flags,message", [
    (4, ["--tp", "3"], "--tp 3 must divide the 4 ranks"),
    (2, ["--tp", "4"], "--tp 4 must divide the 2 ranks"),
    (4, ["--tp", "2", "--batch-size", "3"], "does not divide evenly among 2 data-parallel ranks"),
    (2, ["--generate", "-1"], "--generate: must be 0 or more, got -1"),
], ids=["tp not dividing", "tp larger", "batch over dp", "negative generate"])
def test_lesson_03_refuses_bad_input_once(n, flags, message):
    proc = lesson03(n, *flags)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert text.count(message) == 1, text
    assert "Traceback" not in text and "verdict" not in text, text
