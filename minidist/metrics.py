"""Where the FLOPs and the bytes go: FLOPs per token, a measured peak, MFU, memory by category.

FLOPs per token of training (PaLM, arXiv 2204.02311, appendix B; the formula lives in
minidist/plan/flops.py, with the per-step counts of Narayanan et al. 2021):

    6N + 12 * L * H * Q * T

6N: each parameter does one multiply-add (2 FLOPs) per token forward and two backward
(the gradient for the input and for the weight). N counts every parameter except the
position table (a lookup, no multiply), as nanoGPT's estimate_mfu does; the token table
is counted once although it is also the output layer (tied). 12 L H Q T: attention's
QK^T and AV products, which have no parameters: 2 matmuls x 2 FLOPs x T keys x H*Q,
times 3 for forward and backward, per layer.

MFU = (tokens/s x FLOPs per token) / peak FLOP/s. The peak is measured here, with a
short matrix product in the run's dtype on this process's BLAS threads, or given with
--peak-tflops; never a constant copied from a data sheet for some other chip.
"""
import time

import numpy as np

from minidist.backend import synchronize, to_device, xp
from minidist.plan import flops as plan_flops


def flops_per_token(config, n_params):
    """Training FLOPs per token of a GPTConfig: plan.flops.flops_per_token, 6N + 12 L H Q T
    (N = non-position parameters), with the config's shapes."""
    return plan_flops.flops_per_token(config.n_layer, config.n_head, config.n_embd // config.n_head,
                                      config.block_size, n_params)


_PEAK = {}


def measure_peak_flops(dtype="float32", n=512, seconds=0.3):
    """FLOP/s of a square matrix product of side n in `dtype`: the best of ~`seconds` of tries.

    This is what the BLAS this process uses reaches on this machine, with the threads
    it was started with: the honest denominator for MFU on a CPU.
    """
    key = (np.dtype(dtype).name, n)
    if key not in _PEAK:
        rng = np.random.default_rng(0)
        a = to_device(rng.standard_normal((n, n)).astype(dtype))      # drawn on the host
        b = to_device(rng.standard_normal((n, n)).astype(dtype))
        out = xp.empty((n, n), dtype=dtype)
        xp.matmul(a, b, out=out)  # warm up
        best, start = float("inf"), time.perf_counter()
        while best == float("inf") or time.perf_counter() - start < seconds:   # one timing at least
            t0 = time.perf_counter()
            xp.matmul(a, b, out=out)
            synchronize()
            best = min(best, time.perf_counter() - t0)
        _PEAK[key] = 2.0 * n ** 3 / best
    return _PEAK[key]


def mfu(tokens_per_s, flops_token, peak_flops):
    """Model FLOPs utilisation: the fraction of the peak that went into the model's math."""
    return tokens_per_s * flops_token / peak_flops


def nbytes(arrays):
    """Total bytes of the arrays (None entries count zero)."""
    return int(sum(a.nbytes for a in arrays if a is not None))


def memory_by_category(params, optimizer=None, activations_peak=None):
    """Bytes this process holds, measured from its arrays.

    params: the Parameters (their .data and .grad); optimizer: anything with
    state_bytes(); activations_peak: the engine's peak of arrays saved for backward.
    """
    params = list(params)
    return {
        "params": nbytes(p.data for p in params),
        "grads": nbytes(p.grad for p in params),
        "optimizer": optimizer.state_bytes() if optimizer is not None else 0,
        "activations_peak": activations_peak,
    }
