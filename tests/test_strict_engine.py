"""The engine under the strict device double: the same numbers as on the CPU, the transfers it
should make and no others, and a host/device mix planted in it caught.

The array namespace is chosen once, when minidist.backend is imported, so each device runs in
its own process: PROBE below runs under MINIDIST_DEVICE=cpu and under MINIDIST_DEVICE=strict
(both at once) and writes what it saw; the test compares the two.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

PROBE = r'''
import json, sys
import numpy as np
from minidist import fused, optim, transfers
from minidist.backend import DEVICE, to_numpy, xp
from minidist.model import GPT, GPTConfig
from minidist.tensor import Function, Tensor
from minidist.train import micro_batches, train_step

out = sys.argv[1]
B, T = 2, 8
cfg = GPTConfig(block_size=T, vocab_size=64, n_layer=1, n_head=2, n_embd=8, dtype="float64")
rng = np.random.default_rng(0)
x, y = rng.integers(0, 64, (B, T)), rng.integers(0, 64, (B, T))      # host token ids
arrays, said = {}, {"device": DEVICE}


def moved(before):
    now = transfers.snapshot()
    return {k: now[k] - before[k] for k in ("h2d", "d2h")}


# forward and backward of a tiny GPT, the loss brought home
model = GPT(cfg, seed=0)
before = transfers.snapshot()
logits, loss = model(x, y)
loss.backward()
arrays["loss"] = np.array(loss.item())
said["forward_backward"] = moved(before)
arrays["logits"] = to_numpy(logits.data)
for name, p in model.named_parameters():
    arrays["grad:" + name] = to_numpy(p.grad)

# one optimizer step: two micro-batches, the gradient clipped (its norm comes home)
opt = model.configure_optimizers(0.1, 1e-2)
before = transfers.snapshot()
step_loss, norm = train_step(model, opt, micro_batches(x, y, 0, 0, k=2), 1e-2, grad_clip=1e-3)
said["train_step"] = moved(before)
arrays["step"] = np.array([step_loss, norm])
for name, p in model.named_parameters():
    arrays["weight:" + name] = to_numpy(p.data)


# planted host/device mixes, one per layer of the engine, each beside the clean code: on the
# CPU the two give the same numbers, on the double the planted one is refused
def planted(name, clean, run):
    arrays["clean:" + name] = to_numpy(clean())
    try:
        arrays["planted:" + name] = to_numpy(run())
    except TypeError as e:
        said["planted:" + name] = str(e)


class NumpySoftmax(Function):              # fused.Softmax with np where xp belongs
    @staticmethod
    def forward(ctx, a):
        e = np.exp(a - a.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def host_mask_model():                     # the causal mask built on the host
    fused._CAUSAL.clear()
    fused._causal_bias = lambda n, dtype: np.triu(np.full((n, n), -np.inf, dtype=dtype), k=1)
    return model(x, y)[0].data


probe = Tensor(xp.linspace(-1.0, 1.0, 12).reshape(3, 4))
planted("op", lambda: fused.softmax(probe).data, lambda: NumpySoftmax.apply(probe).data)
planted("optimizer", lambda: xp.asarray(optim.grad_norm_sq(model.parameters())),
        lambda: np.array(sum(float(np.vdot(p.grad, p.grad)) for p in model.parameters())))
planted("model", lambda: model(x, y)[0].data, host_mask_model)
np.savez(out, **arrays)
print(json.dumps(said))
'''


def run_probe(tmp_path):
    """{device: (what it said, its arrays)} for cpu and strict, run side by side."""
    procs = {}
    for device in ("cpu", "strict"):
        env = dict(os.environ, MINIDIST_DEVICE=device, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        procs[device] = subprocess.Popen([sys.executable, "-c", PROBE, str(tmp_path / f"{device}.npz")],
                                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
    out = {}
    for device, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{device}:\n{stderr}"
        with np.load(tmp_path / f"{device}.npz", allow_pickle=False) as z:
            out[device] = json.loads(stdout), {k: z[k] for k in z.files}
    return out


def test_engine_under_the_strict_double(tmp_path):
    runs = run_probe(tmp_path)
    (cpu_said, cpu), (strict_said, strict) = runs["cpu"], runs["strict"]
    assert cpu_said["device"] == "cpu" and strict_said["device"] == "strict"

    # the same ops on the same numbers: every figure equal to the last bit, not nearly
    numbers = sorted(k for k in cpu if not k.startswith(("planted:", "clean:")))
    assert len([k for k in numbers if k.startswith("grad:")]) == 16
    assert sorted(k for k in strict if not k.startswith(("planted:", "clean:"))) == numbers
    for k in numbers:
        assert cpu[k].dtype == strict[k].dtype and np.array_equal(cpu[k], strict[k]), k

    # the transfers: the token ids in (x and y, int64), one float64 out; nothing on the CPU
    ids = 2 * 2 * 8 * 8
    assert cpu_said["forward_backward"] == cpu_said["train_step"] == {"h2d": 0, "d2h": 0}
    assert strict_said["forward_backward"] == {"h2d": ids, "d2h": 8}
    # a step of two micro-batches: the same ids in; out, the two losses and the clipped norm
    assert strict_said["train_step"] == {"h2d": ids, "d2h": 2 * 8 + 8}

    # the planted mixes run on the CPU (the clean code's numbers) and fail on the double
    for layer in ("op", "model", "optimizer"):
        assert np.array_equal(cpu["planted:" + layer], cpu["clean:" + layer]), layer
        assert np.array_equal(strict["clean:" + layer], cpu["clean:" + layer]), layer
        assert "planted:" + layer not in strict, f"the double let a host/device mix in the {layer} through"
    assert strict_said["planted:op"].startswith("Implicit conversion to a NumPy array is not allowed")
    assert strict_said["planted:model"].startswith("Unsupported type <class 'numpy.ndarray'>")
    assert strict_said["planted:optimizer"].startswith("Implicit conversion to a NumPy array is not allowed")


def test_the_report_takes_the_strategy_runs_bytes_per_step():
    from minidist import equivalence, report
    equivalence.RUNS.clear()
    rep = {"figures": None}
    assert report.add_host_device_bytes(rep) is None and rep["figures"] is None   # trained nothing
    equivalence.record_run(3000, 3, strategy=True)
    equivalence.record_run(800, 4, strategy=False)                   # the reference: not this one
    rep = {"figures": {"other": 1}}
    assert report.add_host_device_bytes(rep) == 1000.0
    assert rep["figures"] == {"other": 1, "host_device_bytes_per_step": 1000.0}
    assert equivalence.RUNS == []                                    # the next lesson starts afresh
    equivalence.record_run(800, 4, strategy=False)                   # no strategy ran: the last run
    rep = {"figures": None}
    assert report.add_host_device_bytes(rep) == 200.0 and rep["figures"] == {"host_device_bytes_per_step": 200.0}
    rep = {"figures": {"host_device_bytes_per_step": 7}}              # a lesson's own figure stays
    equivalence.record_run(800, 4, strategy=True)
    assert report.add_host_device_bytes(rep) == 7 and equivalence.RUNS == []
