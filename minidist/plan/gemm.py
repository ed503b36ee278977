"""How fast one matrix product runs for its shape: the GEMM's tiles, its waves, its bytes.

    python -c "from minidist.plan.gemm import *; from minidist.plan.cluster import GPUS; \\
print(shape_factor(2048, 2304, 768, GPUS['a100-80gb']))"

From NVIDIA's "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023): a GEMM
C (M x N) = A (M x K) B (K x N) is cut into output tiles, one per thread block, and the
blocks run in waves of one per streaming multiprocessor (SM). Three effects, as the guide
states them:
  tile quantization  M and N are rounded up to whole tiles (a 257-wide output costs two
                     256-wide tiles);
  wave quantization  the tiles are rounded up to whole waves of the GPU's SMs (A100 108,
                     H100 SXM 132: their whitepapers): 109 tiles on an A100 take two waves;
  memory bound       a GEMM whose FLOPs per byte moved (arithmetic intensity, 2MNK over
                     the 2(MK + KN + MN) bytes of 16-bit A, B, C) is below the GPU's ops:byte
                     ratio (peak FLOP/s / HBM bytes/s: about 153 for A100, 295 for H100)
                     runs at HBM speed, not the tensor cores'.
This project's model of them: the tile is the guide's largest, 256 x 128 (or 128 x 256,
whichever quantizes less; cuBLAS picks among several, the guide says the larger reuse more
data); the time is the longer of (the waves x SMs x the tile's FLOPs at the matmul rate)
and (the bytes / HBM bandwidth). shape_factor is the useful part of that time, 1 for large
GEMMs; the matmul rate (peak x cluster.py's matmul_efficiency) still carries what a large
GEMM and the rest of the step lose. Calculon (Isaev et al. SC'23, systems/a100_80g.json
"gflops_efficiency") uses a coarser table by size alone: 0.95 of its rate from 128 GFLOP,
0.9 from 16, 0.6 from 1.

The GEMMs of one layer's TP shard (layer_gemms), n tokens of a micro-batch: QKV (n x h by
h x (h + 2 h_kv)/t), the output projection (n x h/t by h/t x h), the MLP's up (and SwiGLU's
gate: one h x 2f/t product) and down (f/t x h), and the head's logits (n x h by h x V/t).
Backward runs each as two more products of the same FLOPs, the input's gradient (M x N by
N x K) and the weight's (K x M by M x N) (training_seconds). The attention scores' batched
products are not here: cost.py times them at the matmul rate.
"""
TILES = ((256, 128), (128, 256))
ITEM = 2                      # 16-bit operands


def _ceil(a, b):
    return -(-a // b)


def shape_factor(m, n, k, gpu):
    """Useful FLOPs over the FLOPs the GEMM's waves of tiles occupy, or over what HBM lets
    it do, whichever is less (module docstring); 1.0 for a GPU without an SM count."""
    if not gpu.sms:
        return 1.0
    slots = min(_ceil(_ceil(m, a) * _ceil(n, b), gpu.sms) * gpu.sms * a * b for a, b in TILES)
    tiles = m * n / slots
    rate = gpu.peak_flops * gpu.matmul_efficiency
    intensity = 2 * m * n * k / (ITEM * (m * k + k * n + m * n))
    memory = intensity * gpu.hbm_bytes_per_s / rate      # < 1: bound by HBM
    return min(tiles, memory)


def gemm_seconds(m, n, k, gpu, shapes=True):
    """Seconds of one (m x k) @ (k x n) product: 2mnk / (peak x matmul efficiency x
    shape_factor); shapes False: shape_factor taken as 1."""
    factor = shape_factor(m, n, k, gpu) if shapes else 1.0
    return 2 * m * n * k / (gpu.peak_flops * gpu.matmul_efficiency * factor)


def training_seconds(m, n, k, gpu, shapes=True):
    """Forward, input-gradient and weight-gradient products of one GEMM: (m, n, k),
    (m, k, n), (k, n, m)."""
    return sum(gemm_seconds(*mnk, gpu, shapes) for mnk in ((m, n, k), (m, k, n), (k, n, m)))


def layer_gemms(model, tokens, t):
    """[(name, M, N, K)] of one layer's forward on one TP rank of t: tokens rows (b s/cp)."""
    h, f = model.hidden, model.ffn
    h_kv = model.kv * (h // model.heads)
    up = 2 * f if model.swiglu else f
    return [("qkv", tokens, (h + 2 * h_kv) // t, h), ("proj", tokens, h, h // t),
            ("mlp up", tokens, up // t, h), ("mlp down", tokens, h, f // t)]


def logit_gemm(model, tokens, t):
    """(name, M, N, K) of the head's logits on one TP rank (the vocabulary cut t ways)."""
    return ("logits", tokens, _ceil(model.vocab, t), model.hidden)
