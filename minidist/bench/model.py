"""Time one GPT training step (forward, backward, AdamW) beside PyTorch eager, CPU or GPU.

    make bench                                   # sets one BLAS thread, then runs:
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m minidist.bench model --steps 10
    python -m minidist.bench model --device cuda --peak-tflops 67   # on a GPU (make gpu-check)

The model: n_layer=4, n_head=8, n_embd=256, block_size=128, batch 8, vocab 256. When
`import torch` works, the same model (same initial weights, nn.Linear weights
transposed) is built in PyTorch and the two steps alternate, so both see the same
machine state; the ratio minidist / torch is printed. BLAS threads are fixed when the
library loads, so set the environment variables before Python starts (make does).
MFU uses 6N + 12 L H Q T FLOPs per token and a peak measured here by a matrix product, or
the one --peak-tflops gives (on a GPU its datasheet figure, which make gpu-check passes).

--device (cpu, cuda or strict, default MINIDIST_DEVICE) sets MINIDIST_DEVICE before
minidist.backend is imported. On a device the batch is moved there once, before the timed
steps, and PyTorch runs on CUDA when torch.cuda is available, not at all otherwise.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy

from minidist.cli import json_problem, positive_float, positive_int

DEVICES = ("cpu", "cuda", "strict")

CONFIG = dict(n_layer=4, n_head=8, n_embd=256, block_size=128, vocab_size=256, dropout=0.0, bias=True)
BATCH = 8


def minidist_step(model, opt, x, y):
    from minidist.backend import synchronize

    def step():
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        synchronize()
        return loss.item()
    return step


def torch_step(model, state, config, x, y, device="cpu"):
    """The same GPT in PyTorch eager on `device`, weights copied from `state` (nanoGPT names)."""
    import torch
    from minidist.backend import to_numpy
    import torch.nn as tnn
    import torch.nn.functional as F
    torch.set_num_threads(1)
    dt = {"float32": torch.float32, "float64": torch.float64}[config.dtype]
    C, nh = config.n_embd, config.n_head

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = tnn.LayerNorm(C), tnn.LayerNorm(C)
            self.c_attn, self.attn_proj = tnn.Linear(C, 3 * C), tnn.Linear(C, C)
            self.c_fc, self.mlp_proj = tnn.Linear(C, 4 * C), tnn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(a.transpose(1, 2).reshape(B, T, C))
            h = self.c_fc(self.ln_2(x))                 # the GELU minidist's config names
            return x + self.mlp_proj(F.gelu(h, approximate="tanh" if config.gelu == "tanh" else "none"))

    class TorchGPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte = tnn.Embedding(config.vocab_size, C)
            self.wpe = tnn.Embedding(config.block_size, C)
            self.h = tnn.ModuleList([Block() for _ in range(config.n_layer)])
            self.ln_f = tnn.LayerNorm(C)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for b in self.h:
                x = b(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    tm = TorchGPT().to(dt)
    rename = {"attn.c_attn": "c_attn", "attn.c_proj": "attn_proj", "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}
    with torch.no_grad():
        for name, a in state.items():
            tname = name.replace("transformer.", "")
            for ours, theirs in rename.items():
                tname = tname.replace(ours, theirs)
            a = to_numpy(a)
            t = torch.from_numpy(numpy.ascontiguousarray(a.T if a.ndim == 2 and "wte" not in name and "wpe" not in name else a))
            dict(tm.named_parameters())[tname].copy_(t)
    tm = tm.to(device)
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    tx, ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    def step():
        loss = tm(tx, ty)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def select_device(flag):
    """None once MINIDIST_DEVICE says `flag` (set here when minidist.backend is not imported
    yet), else the one line that refuses the clash."""
    env = os.environ.get("MINIDIST_DEVICE")
    backend = sys.modules.get("minidist.backend")
    if backend is not None and backend.DEVICE != flag:
        return f"--device {flag}: this process already runs on {backend.DEVICE}"
    if env is not None and env.lower() != flag:
        return f"--device {flag} but MINIDIST_DEVICE={env}: give one of them, or the same device"
    os.environ["MINIDIST_DEVICE"] = flag
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidist.bench model", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (each framework)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--no-torch", action="store_true", help="time minidist alone")
    p.add_argument("--device", choices=DEVICES, help="where minidist's arrays live (default: MINIDIST_DEVICE, else cpu)")
    p.add_argument("--peak-tflops", type=positive_float, help="the peak for MFU (default: measured here)")
    p.add_argument("--json", metavar="PATH", help="write the step time, tokens/s and MFU as JSON")
    args = p.parse_args(argv)
    problem = (select_device(args.device) if args.device else None) or (args.json and json_problem(args.json))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from minidist import metrics                    # after MINIDIST_DEVICE is settled
    from minidist.backend import DEVICE, dtype_of, synchronize, to_device
    from minidist.model import GPT, GPTConfig
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: OMP_NUM_THREADS is not 1; BLAS may use several threads (make bench sets it)")

    config = GPTConfig(**CONFIG, dtype=args.dtype)
    model = GPT(config, seed=0)
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (BATCH, config.block_size))
    y = rng.integers(0, config.vocab_size, (BATCH, config.block_size))
    steps = {"minidist": minidist_step(model, model.configure_optimizers(0.1, 1e-3), to_device(x), to_device(y))}
    state = model.state_dict()
    if not args.no_torch:
        try:
            steps["torch"] = torch_step(None, state, config, x, y, **torch_device(DEVICE))
        except ImportError:
            print("torch is not importable: timing minidist alone")
        except LookupError as e:
            print(e)

    first = {name: step() for name, step in steps.items()}          # same weights: same loss
    if "torch" in first:
        print(f"first-step loss: minidist {first['minidist']:.6f}  torch {first['torch']:.6f}")
    for _ in range(args.warmup - 1):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(args.steps):                                       # alternate the two
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)

    tokens = BATCH * config.block_size
    n = model.get_num_params(non_embedding=True)
    flops = metrics.flops_per_token(config, n)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else metrics.measure_peak_flops(dtype_of(args.dtype))
    print(f"GPT L={config.n_layer} H={config.n_head} C={config.n_embd} T={config.block_size} B={BATCH} "
          f"{args.dtype}, N={n:,} parameters, {flops / 1e6:.1f} MFLOP/token")
    if DEVICE != "cpu":
        print(f"device: {DEVICE} (MINIDIST_DEVICE)")
    if args.peak_tflops:
        print(f"peak {args.peak_tflops:g} TFLOP/s, given by --peak-tflops")
    else:
        print(f"peak {peak / 1e9:.1f} GFLOP/s, measured here by a matrix product")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, m in med.items():
        tps = tokens / m
        print(f"{name:>9}: step {m * 1e3:7.1f} ms (median of {args.steps})  {tps:8.0f} tokens/s  "
              f"MFU {metrics.mfu(tps, flops, peak) * 100:5.1f}%")
    if "torch" in med:
        print(f"    ratio: minidist / torch = {med['minidist'] / med['torch']:.2f}")
    if args.json:
        m = med["minidist"]
        out = dict(device=DEVICE, dtype=args.dtype, step_time_s=m, tokens_per_s=tokens / m,
                   mfu=metrics.mfu(tokens / m, flops, peak), peak_flops=peak,
                   peak_source="--peak-tflops" if args.peak_tflops else "measured by a matrix product",
                   torch_step_time_s=med.get("torch"))
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


def torch_device(device):
    """{'device': torch's device} for minidist's; LookupError when PyTorch cannot follow it
    (ImportError when torch is missing: the caller says so)."""
    if device == "cpu":
        return {"device": "cpu"}
    import torch
    if device == "cuda" and torch.cuda.is_available():
        return {"device": "cuda"}
    raise LookupError(f"torch has no CUDA here: timing minidist alone on {device}")


if __name__ == "__main__":
    raise SystemExit(main())
