"""Gradient compression (minidist/parallel/compression.py and the files beside it), on one process.

    python -m pytest -q tests/test_compression.py

1-bit Adam: DeepSpeed's scale (the root mean square), its compressed all-reduce's two
residuals on one rank, its optimizer equal to AdamW with the variance frozen on one rank,
its bytes (plan.traffic.onebit_adam_sent) about 1/32 of fp32's.
1-bit: packing when n is not a multiple of 8, dtype kept, the L1 norm of the
decompressed vector equal to v's, error feedback (v = decompressed + new residual),
zero vectors, no writes into the inputs. int8: the scale, |error| <= scale / 2, zeros.
orthogonalize: orthonormal columns, zero columns for a rank-deficient matrix (no nan).
powersgd_step on one rank (COMM_SELF): full rank gives M back. CompressedDataParallel's
segments (a chunk cut at the parameter boundaries, one scale each), and what one scale
per tensor saves a small tensor beside a large one. plan.traffic's compression formulas by
hand; the exchanges never compare a compressor's name (the table's row says what to do).
"""
import numpy as np
import pytest

from minidist.parallel import compression as C

DTYPES = [np.float32, np.float64]


def data(n, dtype, seed=0):
    return np.random.default_rng([seed, n]).standard_normal(n).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64])
def test_onebit_round_trip(n, dtype):
    x, res = data(n, dtype), data(n, dtype, seed=1) * 0.1
    x0, res0 = x.copy(), res.copy()
    packed, scale, new_res = C.onebit_compress(x, res)
    assert np.array_equal(x, x0) and np.array_equal(res, res0), "onebit_compress wrote into its inputs"
    assert packed.dtype == np.uint8 and packed.shape == (-(-n // 8),), f"packed {packed.shape} {packed.dtype}"
    assert np.asarray(scale).dtype == dtype and new_res.dtype == dtype, "the dtype must be kept"
    v = x + res
    assert np.isclose(scale, np.mean(np.abs(v)), rtol=1e-6), "scale = mean |x + residual|"
    out = C.onebit_decompress(packed, scale, n)
    assert out.dtype == dtype and out.shape == (n,)
    assert np.array_equal(np.sign(out), np.where(v >= 0, 1, -1)), "signs of x + residual (0 counts as +)"
    assert np.all(np.abs(out) == scale)
    assert np.allclose(np.abs(out).sum(), np.abs(v).sum(), rtol=1e-5), "same L1 norm as v"
    assert np.allclose(out + new_res, v, rtol=0, atol=1e-6 if dtype == np.float32 else 1e-15), \
        "decompressed + new residual must give x + residual back"


def test_onebit_zero_and_empty():
    for n in (0, 5):
        packed, scale, res = C.onebit_compress(np.zeros(n), np.zeros(n))
        assert scale == 0 and np.array_equal(res, np.zeros(n))
        assert np.array_equal(C.onebit_decompress(packed, scale, n), np.zeros(n))
    packed, _, _ = C.onebit_compress(np.array([0.0, -1.0, 2.0]), np.zeros(3))
    assert list(np.unpackbits(packed, count=3)) == [1, 0, 1], "zero counts as +"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 13, 1000])
def test_int8_round_trip(n, dtype):
    x = data(n, dtype) * 3
    x0 = x.copy()
    q, scale = C.int8_compress(x)
    assert np.array_equal(x, x0), "int8_compress wrote into its input"
    assert q.dtype == np.int8 and q.shape == x.shape and np.asarray(scale).dtype == dtype
    assert np.isclose(scale, np.max(np.abs(x)) / 127, rtol=1e-6)
    assert np.max(np.abs(q.astype(int))) == 127
    out = C.int8_decompress(q, scale)
    assert out.dtype == dtype
    assert np.all(np.abs(out - x) <= scale / 2 * (1 + 1e-5)), "|error| <= scale / 2 per element"


def test_int8_zero():
    q, scale = C.int8_compress(np.zeros(9, np.float32))
    assert scale == 0 and np.array_equal(q, np.zeros(9, np.int8))
    assert np.array_equal(C.int8_decompress(q, scale), np.zeros(9, np.float32))


def test_orthogonalize():
    rng = np.random.default_rng(3)
    P = rng.standard_normal((10, 4))
    P0 = P.copy()
    Q = C.orthogonalize(P)
    assert np.array_equal(P, P0), "orthogonalize wrote into its input"
    assert np.allclose(Q.T @ Q, np.eye(4), atol=1e-14)
    assert np.allclose(Q @ (Q.T @ P), P, atol=1e-13), "same column space as P"


def test_orthogonalize_rank_deficient():
    rng = np.random.default_rng(4)
    A = rng.standard_normal((8, 2))
    P = np.column_stack([A[:, 0], A[:, 1], A[:, 0] - 2 * A[:, 1], np.zeros(8)])   # rank 2
    Q = C.orthogonalize(P)
    assert not np.any(np.isnan(Q)), "a dependent or zero column gave nan"
    assert np.allclose(Q[:, 2:], 0), "dependent and zero columns must stay zero"
    assert np.allclose(Q[:, :2].T @ Q[:, :2], np.eye(2), atol=1e-14)
    assert np.allclose(Q @ (Q.T @ P), P, atol=1e-13), "P @ P.T still projects onto P's columns"
    assert np.array_equal(C.orthogonalize(np.zeros((5, 3))), np.zeros((5, 3)))


def test_powersgd_one_rank_full_rank():
    from mpi4py import MPI
    rng = np.random.default_rng(5)
    M, Q = rng.standard_normal((6, 4)), rng.standard_normal((4, 4))
    M0, Q0 = M.copy(), Q.copy()
    approx, Q_new = C.powersgd_step(MPI.COMM_SELF, M, Q)
    assert np.array_equal(M, M0) and np.array_equal(Q, Q0), "powersgd_step wrote into its inputs"
    assert Q_new.shape == (4, 4)
    assert np.max(np.abs(approx - M)) <= 1e-12 * np.max(np.abs(M))


def test_ring_bytes():
    # 10 items on 4 ranks: chunks 3, 3, 2, 2
    assert [C.ring_bytes(10, 4, r, 4) for r in range(4)] == [4 * (20 - 3 - 3), 4 * (20 - 3 - 2),
                                                             4 * (20 - 2 - 2), 4 * (20 - 2 - 3)]
    assert C.ring_bytes(10, 1, 0, 4) == 0


class Fake:
    def __init__(self, shapes):
        from types import SimpleNamespace
        self.ps = [SimpleNamespace(data=np.zeros(s), grad=None) for s in shapes]

    def parameters(self):
        return list(self.ps)

    def named_parameters(self):
        return [(f"p{i}", p) for i, p in enumerate(self.ps)]


def test_bad_arguments():
    from mpi4py import MPI
    comm, model = MPI.COMM_SELF, Fake([(5, 3), (4, 8), (7,)])
    with pytest.raises(ValueError, match="none, fp16, int8, 1bit, 1bit-adam, powersgd"):
        C.CompressedDataParallel(model, comm, "2bit")
    with pytest.raises(ValueError, match="largest allowed rank is 4"):
        C.CompressedDataParallel(model, comm, "powersgd", rank=5)
    with pytest.raises(ValueError, match="largest allowed rank"):
        C.CompressedDataParallel(model, comm, "powersgd", rank=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        C.CompressedDataParallel(model, comm, "1bit", warmup_steps=-1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        C.CompressedDataParallel(model, comm, "powersgd", bucket_bytes=64)
    with pytest.raises(ValueError, match="1bit-adam needs warmup_steps >= 1"):
        C.CompressedDataParallel(model, comm, "1bit-adam", warmup_steps=0)
    with pytest.raises(ValueError, match="scales must be 'tensor'"):
        C.CompressedDataParallel(model, comm, "int8", scales="bucket")
    dp = C.CompressedDataParallel(model, comm, "powersgd", rank=4)
    assert dp.ranks == {0: 3, 1: 4}, "each matrix gets min(rank, n, m)"


def test_one_rank_formulas():
    """On one rank nothing travels; the run formula counts warm-up steps as uncompressed."""
    from mpi4py import MPI
    dp = C.CompressedDataParallel(Fake([(5, 3), (7,)]), MPI.COMM_SELF, "1bit", warmup_steps=3)
    assert dp.bytes_formula() == dp.uncompressed_bytes() == dp.compressed_bytes() == dp.run_formula(10) == 0


def test_the_synchroniser_calls_the_module_functions():
    """A student's function plugged in as the grader does (minidist/grader/plugin.py: every
    module holding the answer) is the one the synchroniser uses."""
    import contextlib
    from mpi4py import MPI
    from minidist.grader.plugin import plugged
    calls = []
    names = ("onebit_compress", "onebit_decompress", "int8_compress", "int8_decompress", "orthogonalize")
    with contextlib.ExitStack() as stack:
        for name in names:
            original = getattr(C, name)
            spy = lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a)
            stack.enter_context(plugged(original, spy))
        for compressor in ("1bit", "int8", "powersgd"):
            model = Fake([(5, 3), (7,)])
            for p in model.ps:
                p.grad = np.ones(p.data.shape)
            C.CompressedDataParallel(model, MPI.COMM_SELF, compressor, rank=2).sync()
    assert set(calls) == set(names)
    assert C.onebit_compress.__module__ == "minidist.parallel.compressors", "put back"


def test_segments_cut_chunks_at_parameter_boundaries():
    """One rank, one chunk of 35 numbers: "tensor" cuts it at 15, 22, 34 (the parameters
    5 x 3, 7, 2 x 3 x 2, 1); buckets of 10 numbers cut it at their own bounds too; "chunk"
    keeps it whole. The formula's message: a scale and a payload per segment."""
    from mpi4py import MPI
    model = Fake([(5, 3), (7,), (2, 3, 2), (1,)])
    assert C.CompressedDataParallel(model, MPI.COMM_SELF, "1bit").scales == "chunk", "1bit's default"
    assert C.CompressedDataParallel(model, MPI.COMM_SELF, "int8").scales == "tensor", "int8's default"
    dp = C.CompressedDataParallel(model, MPI.COMM_SELF, "1bit", scales="tensor")
    assert dp.layout == [([0, 35], [[(0, 15), (15, 22), (22, 34), (34, 35)]])]
    assert dp._message_bytes(dp.layout[0][1][0]) == 4 * 8 + 2 + 1 + 2 + 1     # ceil per segment
    dp = C.CompressedDataParallel(model, MPI.COMM_SELF, "int8", bucket_bytes=80)
    assert [seg for _, (seg,) in dp.layout] == [[(0, 10)], [(0, 5), (5, 10)], [(0, 2), (2, 10)],
                                                [(0, 4), (4, 5)]]
    dp = C.CompressedDataParallel(model, MPI.COMM_SELF, "int8", scales="chunk")
    assert dp.layout == [([0, 35], [[(0, 35)]])]


def test_one_scale_per_tensor_keeps_a_small_tensor():
    """A tensor of gradients ~1e-3 beside one of ~1e3, in one chunk: with one scale per
    chunk (1e3 / 127) int8 rounds the small one to 0; with one per tensor each element is
    within its own tensor's two half-scales (phase 1 and phase 2)."""
    from mpi4py import MPI
    for scales in ("tensor", "chunk"):
        model = Fake([(4, 5), (9,)])
        big, small = data(20, np.float64).reshape(4, 5) * 1e3, data(9, np.float64, seed=2) * 1e-3
        model.ps[0].grad, model.ps[1].grad = big.copy(), small.copy()
        C.CompressedDataParallel(model, MPI.COMM_SELF, "int8", scales=scales).sync()
        got = model.ps[1].grad
        if scales == "chunk":
            assert np.array_equal(got, np.zeros(9)), "one scale per chunk should lose the small tensor"
        else:
            assert np.all(np.abs(got - small) <= np.max(np.abs(small)) / 127 * (1 + 1e-9)), \
                "one scale per tensor: the small tensor within its own scale"
            assert np.all(np.abs(model.ps[0].grad - big) <= np.max(np.abs(big)) / 127 * (1 + 1e-9))


def test_scaled_sign_uses_the_root_mean_square():
    v = np.array([3.0, -4.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.0, -1.0])
    packed, scale = C.scaled_sign(v)
    assert scale == np.linalg.norm(v) / 3 and packed.shape == (2,)
    out = C.onebit_decompress(packed, scale, 9)
    assert np.array_equal(out, np.where(v >= 0, scale, -scale))      # a zero counts as +


def test_compressed_allreduce_keeps_what_it_did_not_send_on_one_rank():
    """One rank: worker then server code the vector; each residual holds what its code
    missed, so out + worker residual + server residual moves exactly with x."""
    from mpi4py import MPI
    rng = np.random.default_rng(3)
    worker, server, total_out, total_x = np.zeros(21), np.zeros(21), np.zeros(21), np.zeros(21)
    for _ in range(4):
        x = rng.standard_normal(21)
        x0 = x.copy()
        out = C.compressed_allreduce(MPI.COMM_SELF, x, worker, server)
        assert np.array_equal(x, x0) and len(set(np.abs(out))) == 1       # one scale, signs
        total_out += out
        total_x += x
        assert np.allclose(total_out + worker + server, total_x, rtol=0, atol=1e-12)


def test_one_bit_adam_on_one_rank_is_adamw_with_the_variance_frozen():
    """Warm-up: AdamW itself. After it, with nothing to average, the same arithmetic as
    AdamW with freeze_variance(): the update formula, bias corrections and weight decay."""
    from mpi4py import MPI
    from minidist.nn import Parameter
    from minidist.optim import AdamW
    rng = np.random.default_rng(4)
    start = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    runs = []
    for onebit in (False, True):
        ps = [Parameter(a.copy()) for a in start]
        inner = AdamW([{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}],
                      lr=1e-2)
        model = Fake([(3, 4), (5,)])
        model.ps = ps
        dp = C.CompressedDataParallel(model, MPI.COMM_SELF, "1bit-adam", warmup_steps=2)
        opt = C.OneBitAdam(inner, dp) if onebit else inner
        for step in range(5):
            for i, p in enumerate(ps):
                p.grad = np.random.default_rng([step, i]).standard_normal(p.data.shape)
            if onebit:
                dp.sync()
            elif step == 2:
                inner.freeze_variance()
            opt.step()
        runs.append([p.data.copy() for p in ps])
        assert inner.variance_frozen
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_one_bit_adam_leaves_out_a_parameter_that_had_no_gradient_in_the_warm_up():
    """A parameter no gradient reached during the warm-up has no AdamW state (no v to
    freeze): the compressed steps leave it as it is, and the others step as AdamW with the
    variance frozen does without it."""
    from mpi4py import MPI
    from minidist.nn import Parameter
    from minidist.optim import AdamW
    rng = np.random.default_rng(5)
    start = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    runs = []
    for onebit in (False, True):
        ps = [Parameter(a.copy()) for a in start]
        model = Fake([(3, 4), (5,)])
        model.ps = ps
        dp = C.CompressedDataParallel(model, MPI.COMM_SELF, "1bit-adam", warmup_steps=2)
        inner = AdamW(ps if onebit else ps[:1], lr=1e-2)
        opt = C.OneBitAdam(inner, dp) if onebit else inner
        for step in range(5):
            for i, p in enumerate(ps):
                p.grad = np.random.default_rng([step, i]).standard_normal(p.data.shape)
            if onebit:
                dp.sync()
            elif step == 2:
                inner.freeze_variance()
            if step < 2:
                ps[1].grad = None                      # no gradient reached it in the warm-up
            opt.step()
        assert id(ps[1]) not in inner.state
        runs.append([p.data.copy() for p in ps])
    assert np.array_equal(runs[0][0], runs[1][0]) and not np.array_equal(runs[1][0], start[0])
    assert np.array_equal(runs[1][1], start[1])


def test_one_bit_adam_bytes_are_a_32nd_of_fp32s():
    from minidist.plan.traffic import onebit_adam_sent
    # 100 values on 4 ranks: chunks 25 each, 4 + ceil(25 / 8) = 8 bytes a message, 3 + 3 messages
    assert [onebit_adam_sent(100, 4, r, 4) for r in range(4)] == [48] * 4
    assert onebit_adam_sent(100, 1, 0, 4) == 0
    n = 10 ** 6
    assert abs(onebit_adam_sent(n, 4, 0, 4) / C.ring_bytes(n, 4, 0, 4) - 1 / 32) < 1e-4


def test_the_byte_formulas_in_plan():
    """plan.traffic's compression formulas by hand: uneven chunks, per-segment rounding, the
    two phases' skipped messages, PowerSGD's three all-reduces, a run's warm-up."""
    from minidist.plan import traffic as T
    assert [T.code_bytes(n, 1) for n in (0, 1, 8, 9)] == [0, 1, 1, 2] and T.code_bytes(9, 8) == 9
    assert T.message_bytes([15, 7], 4, 1) == (4 + 2) + (4 + 1)
    # messages 10, 20, 30: rank 0 skips its own (10) and its right neighbour's (20)
    assert [T.two_phase_sent([10, 20, 30], r) for r in range(3)] == [120 - 30, 120 - 50, 120 - 40]
    assert T.two_phase_sent([10], 0) == 0
    # 2 x 3 rank 1 and 4 x 5 rank 2, vectors 7: all-reduces of 2 + 8, 3 + 10 and 7 numbers
    assert T.powersgd_sent([(2, 3, 1), (4, 5, 2)], 7, 2, 0, 8) == sum(
        T.ring_bytes(c, 2, 0, 8) for c in (10, 13, 7)) == 8 * (10 + 13 + 7)
    assert T.compressed_run_sent(10, 3, 100, 1) == 3 * 100 + 7 and T.compressed_run_sent(2, 3, 100, 1) == 200


def test_no_branch_on_a_compressor_name_outside_the_table():
    """The exchanges read a compressor's row (compressors.TABLE), never compare its name."""
    import ast
    import inspect
    from minidist.parallel import compressors, onebit_adam, powersgd
    names = set(compressors.COMPRESSORS)
    for module in (C, onebit_adam, powersgd):
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                found = [n.value for part in [node.left, *node.comparators] for n in ast.walk(part)
                         if isinstance(n, ast.Constant) and n.value in names]
                assert not found, f"{module.__name__} line {node.lineno} compares with {found}"
