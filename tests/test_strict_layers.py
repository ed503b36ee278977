"""A host/device mix planted in each layer is caught by the strict device double.

One test per layer, named test_strict_catches_<layer>: a subprocess under
MINIDIST_DEVICE=strict runs a small piece of the layer twice, once as written (it must run)
and once with one line replaced by a host-mixing version (it must raise CuPy's TypeError).
The array namespace is chosen when minidist.backend is imported, hence the subprocess.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_strict(code, timeout=60):
    """Run `code` under MINIDIST_DEVICE=strict; return the JSON it prints last."""
    env = dict(os.environ, MINIDIST_DEVICE="strict", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# the sharded-data-parallel layers (parallel/data_parallel.py, flat_shards.py, zero.py,
# fsdp.py): one step of a tiny GPT under the strategy, at one rank (the collectives still
# stage through the host); attempt() -> {"error", "where", "moved"}
STEP_PIECE = r'''
import json, traceback
import numpy as np
from mpi4py import MPI
from minidist import transfers
from minidist.model import GPT, GPTConfig
from minidist.train import micro_batches, train_step
comm = MPI.COMM_WORLD
cfg = GPTConfig(block_size=4, vocab_size=16, n_layer=1, n_head=1, n_embd=4, dtype="float64")
rng = np.random.default_rng(0)
x, y = rng.integers(0, 16, (2, 4)), rng.integers(0, 16, (2, 4))


def attempt(make):
    model = GPT(cfg, seed=0)
    opt = model.configure_optimizers(0.0, 1e-2)
    before = transfers.snapshot()
    try:
        runner, dp = make(model, opt)
        train_step(model, runner, micro_batches(x, y, 0, 0), 1e-2, dp=dp)
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()
    return {"error": None, "moved": now["h2d"] + now["d2h"] - before["h2d"] - before["d2h"]}
'''
IMPLICIT = "Implicit conversion to a NumPy array is not allowed"


def test_strict_catches_data_parallel():
    said = run_strict(STEP_PIECE + r'''
from minidist.parallel import data_parallel
make = lambda model, opt: (opt, data_parallel.BucketedDataParallel(model, comm, bucket_bytes=256))
clean = attempt(make)
data_parallel.xp = np                # planted: the gradient buckets made by NumPy, on the host
print(json.dumps({"clean": clean, "planted": attempt(make)}))
''')
    clean, planted = said["clean"], said["planted"]
    assert clean["error"] is None and clean["moved"] > 0      # the buckets staged through the host
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "_grad_ready" in planted["where"]                  # copying a gradient into its bucket


def test_strict_catches_zero():
    said = run_strict(STEP_PIECE + r'''
from minidist.parallel import flat_shards
from minidist.parallel.zero import ZeRO
def make(model, opt):
    zero = ZeRO(model, opt, comm, stage=2, bucket_bytes=256)
    return zero, zero
clean = attempt(make)
flat_shards.xp = np                  # planted: the flat gradient buffers made by NumPy, on the host
print(json.dumps({"clean": clean, "planted": attempt(make)}))
''')
    clean, planted = said["clean"], said["planted"]
    assert clean["error"] is None and clean["moved"] > 0
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "flat_grads" in planted["where"]                   # a gradient copied into the flat buffer


def test_strict_catches_fsdp():
    said = run_strict(STEP_PIECE + r'''
from minidist.parallel import fsdp
make = lambda model, opt: (lambda f: (f, f))(fsdp.FSDP(model, opt, comm))
clean = attempt(make)
def host_gather(comm, group):        # planted: MPI's own Allgather of a unit's shard, into host memory
    full = np.empty(group.n, group.dtype)
    comm.Allgather(group.shard, full)
    group.point(full)
    return full
fsdp.gather_params = host_gather
print(json.dumps({"clean": clean, "planted": attempt(make)}))
''')
    clean, planted = said["clean"], said["planted"]
    assert clean["error"] is None and clean["moved"] > 0
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "host_gather" in planted["where"]                  # the shard handed to MPI as it is


def test_strict_catches_checkpoint():
    said = run_strict(STEP_PIECE + r'''
import tempfile
from minidist.backend import to_numpy
from minidist.checkpoint import layouts
def save_and_load():                 # one step, a save, a load into other weights: equal?
    model = GPT(cfg, seed=0)
    opt = model.configure_optimizers(0.0, 1e-2)
    train_step(model, opt, micro_batches(x, y, 0, 0), 1e-2)
    other = GPT(cfg, seed=1)
    other_opt = other.configure_optimizers(0.0, 1e-2)
    before = transfers.snapshot()
    try:
        with tempfile.TemporaryDirectory() as root:
            layouts.load(comm, layouts.save(comm, root, 1, model, opt), other, other_opt)
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()
    same = all((to_numpy(p.data) == to_numpy(q.data)).all()
               for p, q in zip(model.parameters(), other.parameters()))
    return {"error": None, "same": bool(same), "d2h": now["d2h"] - before["d2h"],
            "h2d": now["h2d"] - before["h2d"], "state": 3 * sum(p.data.nbytes for p in model.parameters())}
clean = save_and_load()
layouts.to_numpy = np.asarray        # planted: a save that hands device pieces to NumPy
home = save_and_load()
layouts.to_numpy, layouts.to_device = to_numpy, np.asarray   # planted: a load that writes host arrays
print(json.dumps({"clean": clean, "save": home, "load": save_and_load()}))
''')
    clean, save, load = said["clean"], said["save"], said["load"]
    assert clean["error"] is None and clean["same"] is True, clean
    assert clean["d2h"] == clean["h2d"] == clean["state"] > 0, clean   # weights, m, v: home once, back once
    assert save["error"] is not None and save["error"].startswith(IMPLICIT), save
    assert "pieces_of" in save["where"]                       # the save's one crossing
    assert load["error"] is not None and "Unsupported type <class 'numpy.ndarray'>" in load["error"], load
    assert "load_into" in load["where"]                       # the load's one crossing


def test_strict_catches_compression():
    said = run_strict(STEP_PIECE + r'''
from minidist.parallel import compressors
from minidist.parallel.compression import CompressedDataParallel
make = lambda model, opt: (opt, CompressedDataParallel(model, comm, "1bit"))
clean = attempt(make)
compressors.ns = lambda x: np        # planted: the 1-bit code written with np., as the host's was
print(json.dumps({"clean": clean, "planted": attempt(make)}))
''')
    clean, planted = said["clean"], said["planted"]
    assert clean["error"] is None and clean["moved"] > 0      # the 1-bit messages staged for MPI
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "onebit_compress" in planted["where"]              # the code of one chunk


def test_strict_catches_precision():
    said = run_strict(STEP_PIECE + r'''
from minidist import precision
def make16(kind):
    def make(model, opt):
        return precision.MixedPrecision(opt, model, kind), None
    return make
def fp16_step():                     # one fp16 step under autocast, loss scaling included
    model = GPT(cfg, seed=0)
    opt = precision.MixedPrecision(model.configure_optimizers(0.0, 1e-2), model, "fp16")
    try:
        with precision.autocast("fp16"):
            train_step(model, opt, micro_batches(x, y, 0, 0), 1e-2, scaler=precision.GradScaler())
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    return {"error": None}
with precision.autocast("bf16"):
    bf16 = attempt(make16("bf16"))
clean = fp16_step()
def host_unscale(grads, scale):      # planted: the gradients unscaled by NumPy, on the host
    u = [np.asarray(g, dtype=np.float32) / np.float32(scale) for g in grads]
    return u, not all(np.isfinite(a).all() for a in u)
precision.unscale_grads = host_unscale
planted = fp16_step()
precision.store16 = lambda a, dt: a.astype(dt)   # planted: bf16 weights as ml_dtypes' bfloat16
model = GPT(cfg, seed=0)
try:
    precision.MixedPrecision(model.configure_optimizers(0.0, 1e-2), model, "bf16")
    bf16_dtype = None
except ValueError as e:
    bf16_dtype = str(e)
print(json.dumps({"bf16": bf16, "clean": clean, "planted": planted, "bf16_dtype": bf16_dtype}))
''')
    assert said["bf16"]["error"] is None and said["bf16"]["moved"] > 0, said["bf16"]
    assert said["clean"]["error"] is None, said["clean"]
    planted = said["planted"]
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "host_unscale" in planted["where"]
    assert said["bf16_dtype"] and said["bf16_dtype"].startswith("Unsupported dtype"), said


def test_strict_catches_pipeline_parallel():
    said = run_strict(STEP_PIECE + r'''
from minidist.backend import on_device, to_numpy, xp
from minidist.comm import staging
from minidist.parallel import pipeline_parallel as pp
from minidist.strict import CudaAwareComm as CudaAware   # a CUDA-aware MPI's stand-in
def sent_to_self(comm=MPI.COMM_SELF):   # an activation through the pipeline's own exchange, to this rank
    act = xp.arange(24, dtype=xp.float64).reshape(2, 3, 4)
    before = transfers.snapshot()
    try:
        got, req = pp.exchange(comm, (pp.message(act), 0, 5), ((2, 3, 4), np.float64, 0, 5))
        req.Wait()
        back = pp.to_device(got)
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()       # before the check's own to_numpy
    return {"error": None, "same": bool((to_numpy(back) == np.arange(24.0).reshape(2, 3, 4)).all()),
            "landed_on_device": on_device(got), **{k: now[k] - before[k] for k in now}}
def make(model, opt):                # one stage (p = 1), two micro-batches
    stage = pp.PipelineGPT(model, 1, 0)
    return opt, pp.PipelineParallel(stage, comm, "1f1b", 2)
def step():
    model = GPT(cfg, seed=0)
    opt = model.configure_optimizers(0.0, 1e-2)
    runner, dp = make(model, opt)
    before = transfers.snapshot()
    try:
        train_step(dp.model, runner, micro_batches(x, y, 0, 0, 2), 1e-2, dp=dp)
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()
    return {"error": None, "moved": now["h2d"] + now["d2h"] - before["h2d"] - before["d2h"]}
clean, clean_step = sent_to_self(), step()
staging.DIRECT = True                # MPI reads device memory: nothing is staged
direct = sent_to_self(CudaAware(MPI.COMM_SELF))
staging.DIRECT = False
pp.message = lambda a: a             # planted: the device activation handed to MPI as it is
planted = sent_to_self()
pp.to_device = np.asarray            # planted: the token ids left on the host
print(json.dumps({"clean": clean, "direct": direct, "step": clean_step, "planted": planted, "ids": step()}))
''')
    clean, direct, step, planted, ids = (said[k] for k in ("clean", "direct", "step", "planted", "ids"))
    assert clean["error"] is None and clean["same"] is True, clean
    # staged: home to be sent, back once received
    assert (clean["d2h"], clean["h2d"], clean["mpi_device"]) == (24 * 8, 24 * 8, 0), clean
    assert clean["landed_on_device"] is False
    # direct: MPI reads the device buffer and writes the one it receives into; no copy
    assert direct["error"] is None and direct["same"] is True and direct["landed_on_device"] is True, direct
    assert (direct["d2h"], direct["h2d"], direct["mpi_device"]) == (0, 0, 2 * 24 * 8), direct
    # the step: token ids and targets in (2 x 2 x 4 int64), the 2 losses out, nothing else
    assert step["error"] is None and step["moved"] == 2 * 2 * 4 * 8 + 2 * 8, step
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "exchange" in planted["where"]                     # MPI's Isend given a device buffer
    assert ids["error"] is not None and "Unsupported type <class 'numpy.ndarray'>" in ids["error"], ids
    assert "forward_chunk" in ids["where"]                    # the embedding indexed with host ids


def test_strict_catches_parallel_3d():
    said = run_strict(STEP_PIECE + r'''
from minidist.backend import to_numpy, xp
from minidist.comm import ProcessGrid
from minidist.parallel import parallel_3d, tp_model
grid = ProcessGrid(tp=1, pp=1, dp=1, comm=comm)
model = GPT(cfg, seed=0)
stage, tpm = parallel_3d.build_stage(model, grid)
opt = GPT.configure_optimizers(stage, 0.0, 1e-2)
slot = parallel_3d.Parallel3D(stage, tpm, grid, "1f1b", 2, opt)
train_step(stage, slot, micro_batches(x, y, 0, 0, 2), 1e-2, 0.5, dp=slot)
ref = {f"weight:{n}": to_numpy(p.data) for n, p in stage.named_parameters()}   # host, as compared
def cut():                           # every weight, cut as this rank holds it, against its own
    try:
        mine = {k: parallel_3d.reference_value(k, ref, tpm) for k in ref}
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    return {"error": None, "host": all(type(v) is np.ndarray for v in mine.values()),
            "same": all((mine[k] == ref[k]).all() for k in ref)}
clean = cut()
parallel_3d.shard = lambda full, *a: tp_model.shard(xp.asarray(full), *a)   # planted: cut on the device
print(json.dumps({"clean": clean, "planted": cut()}))
''')
    clean, planted = said["clean"], said["planted"]
    assert clean["error"] is None and clean["host"] is True and clean["same"] is True, clean
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "reference_value" in planted["where"]              # np.asarray of the device piece


def test_strict_catches_tensor_parallel():
    said = run_strict(STEP_PIECE + r'''
from minidist.backend import to_numpy, xp
from minidist.comm import all_reduce
from minidist.parallel import tensor_parallel, tp_model
def tp_step():                       # one step, sequence parallel, clipped, at tp = 1 (still staged)
    model = tp_model.TensorParallelGPT(GPT(cfg, seed=0), comm, sequence_parallel=True)
    opt = model.configure_optimizers(0.0, 1e-2)
    before = transfers.snapshot()
    try:
        train_step(model, opt, micro_batches(x, y, 0, 0), 1e-2, 0.5, dp=tp_model.TensorParallelSync(model))
        now = transfers.snapshot()
        whole = tp_model.gather_state(model)
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    ref = GPT(cfg, seed=0)
    train_step(ref, ref.configure_optimizers(0.0, 1e-2), micro_batches(x, y, 0, 0), 1e-2, 0.5)
    same = all(np.allclose(whole[n], to_numpy(p.data), rtol=1e-12, atol=0) for n, p in ref.named_parameters())
    return {"error": None, "same": same, "host": all(type(v) is np.ndarray for v in whole.values()),
            "moved": now["h2d"] + now["d2h"] - before["h2d"] - before["d2h"]}
clean = tp_step()
def as_is(comm, a, op="sum"):        # planted: the device array handed to MPI's own Allreduce
    out = xp.empty_like(a)
    comm.Allreduce(a, out, op=MPI.MAX if op == "max" else MPI.SUM)
    return out
tensor_parallel.all_reduce = as_is
planted = tp_step()
tensor_parallel.all_reduce = all_reduce
tp_model.kind_of = lambda a: xp      # planted: the shards gathered home, joined with xp
print(json.dumps({"clean": clean, "planted": planted, "gather": tp_step()}))
''')
    clean, planted, gather = said["clean"], said["planted"], said["gather"]
    assert clean["error"] is None and clean["same"] is True and clean["host"] is True, clean
    assert clean["moved"] > 0, clean                          # the f/g collectives staged through the host
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "as_is" in planted["where"]                        # MPI's Allreduce given a device buffer
    assert gather["error"] is not None and "Unsupported type <class 'numpy.ndarray'>" in gather["error"], gather
    assert "unshard" in gather["where"]                       # host pieces given to the device's split


def test_strict_catches_recompute():
    said = run_strict(STEP_PIECE + r'''
from minidist import recompute
from minidist.backend import to_numpy
from minidist.tensor import Tensor
def step(policy):                    # one step under a policy: the gradients home, the bytes moved
    model = GPT(cfg, seed=0)
    model.set_recompute(policy)
    raw, before = {}, transfers.snapshot()
    try:
        train_step(model, model.configure_optimizers(0.0, 1e-2), micro_batches(x, y, 0, 0), 1e-2, raw_grads=raw)
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()
    return {"error": None, "grads": {n: to_numpy(g).tolist() for n, g in raw.items() if g is not None},
            "moved": now["h2d"] + now["d2h"] - before["h2d"] - before["d2h"]}
none, full = step("none"), step("full")
rerun = recompute.checkpoint_backward
def host_copies(fn, inputs, counters, grad):   # planted: the saved inputs kept as host copies
    kept = [Tensor(np.array(t.data), requires_grad=t.requires_grad) if isinstance(t, Tensor) else t
            for t in inputs]
    return rerun(fn, kept, counters, grad)
recompute.checkpoint_backward = host_copies
print(json.dumps({"none": none, "full": full, "planted": step("full")}))
''')
    none, full, planted = said["none"], said["full"], said["planted"]
    assert none["error"] is None and full["error"] is None, (none, full)
    assert full["grads"] == none["grads"] and full["grads"], "the rerun changed a gradient"
    assert full["moved"] == none["moved"] > 0, (none, full)  # the rerun moves nothing more (no dropout)
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "host_copies" in planted["where"]                  # np.array of a saved device input


def test_strict_catches_offload():
    said = run_strict(STEP_PIECE + r'''
from minidist.parallel import offload
from minidist.parallel.zero import ZeRO
zeros = []
def make(model, opt):
    zero = ZeRO(model, opt, comm, stage=2, offload="disk", chunk_bytes=64)
    zeros.append(zero)
    return zero, zero
clean = attempt(make)
clean["files"] = dict(zeros[-1].offload_bytes(), read_by_kind=None)
def host_read(self, kind, lo, hi, out):   # planted: a chunk of the file put into a device buffer as it is
    out[...] = self.maps[kind][lo:hi]
offload.DiskStore.read = host_read
planted = attempt(make)
for z in zeros:
    z.close()
print(json.dumps({"clean": clean, "planted": planted}))
''')
    clean, planted = said["clean"], said["planted"]
    files = clean["files"]
    assert clean["error"] is None and files["steps"] == 1, clean
    # m and v read to the device and written back, each byte counted (besides the ids, the loss,
    # the norm and the collectives' staging)
    assert files["bytes_read"] == files["bytes_written"] > 0 and clean["moved"] > 2 * files["bytes_read"], clean
    assert planted["error"] is not None and "Unsupported type <class 'numpy" in planted["error"], planted
    assert "host_read" in planted["where"]


def test_strict_catches_moe():
    said = run_strict(STEP_PIECE + r'''
from minidist import moe
from minidist.backend import to_device, xp
from minidist.tensor import Tensor
layer_cfg = GPTConfig(n_layer=1, n_head=1, n_embd=4, n_expert=4, top_k=2, capacity_factor=1.0)
x = to_device(rng.normal(size=(2, 6, 4)))
def layer():                         # one MoE layer, forward and backward: the bytes that crossed
    m = moe.MoEMLP(layer_cfg)
    before = transfers.snapshot()
    try:
        m(Tensor(x, requires_grad=True)).sum().backward()
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()
    return {"error": None, "kept": int(m.aux["tokens_per_expert"].sum()),
            "d2h": now["d2h"] - before["d2h"], "h2d": now["h2d"] - before["h2d"]}
clean = layer()
moe.to_device = np.asarray           # planted: the routing's indices left on the host
print(json.dumps({"clean": clean, "planted": layer()}))
''')
    clean, planted = said["clean"], said["planted"]
    T, E, k = 12, 4, 2
    assert clean["error"] is None, clean
    assert clean["d2h"] == T * E * 8, clean                   # the gates home, once
    # back: each token's experts (int64) and kept choices (bool), the kept rows' (token,
    # choice) pairs (int64), the balance loss's fractions f (float64)
    assert clean["h2d"] == T * k * 9 + 2 * clean["kept"] * 8 + E * 8, clean
    assert planted["error"] is not None and "Unsupported type <class 'numpy.ndarray'>" in planted["error"]
    assert "combine_weights" in planted["where"], planted     # the gates indexed with host experts


def test_strict_catches_expert_parallel():
    said = run_strict(STEP_PIECE + r'''
from minidist.parallel import expert_parallel as ep
cfg = GPTConfig(block_size=4, vocab_size=16, n_layer=1, n_head=1, n_embd=4, dtype="float64",
                n_expert=2, top_k=2, capacity_factor=1.0, moe_every=1)
def make(model, opt):                # one rank holds both experts; its tokens go through all_to_all_v
    dp = ep.expert_parallel(model, comm, pad_to_capacity=True)
    return model.configure_optimizers(0.0, 1e-2), dp
clean = attempt(make)
def host_pad(chunk, counts, pad):    # planted: the padded buffer made by NumPy, on the host
    out = np.zeros((len(counts) * pad,) + chunk.shape[1:], chunk.dtype)
    at = 0
    for i, c in enumerate(counts.tolist()):
        out[i * pad:i * pad + c] = chunk[at:at + c]
        at += c
    return out
ep._pad = host_pad
print(json.dumps({"clean": clean, "planted": attempt(make)}))
''')
    clean, planted = said["clean"], said["planted"]
    assert clean["error"] is None and clean["moved"] > 0, clean   # the rows staged for MPI
    assert planted["error"] is not None and planted["error"].startswith(IMPLICIT), planted
    assert "host_pad" in planted["where"], planted           # a device row written into host memory


def test_strict_catches_context_parallel():
    said = run_strict(r'''
import json, traceback
import numpy as np
from mpi4py import MPI
from minidist import transfers
from minidist.backend import to_numpy, xp
from minidist.parallel import context_parallel as cp
k = xp.arange(48, dtype=xp.float64).reshape(2, 1, 6, 4)
def catch(piece):
    before = transfers.snapshot()
    try:
        out = piece()
    except TypeError as e:
        return {"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}
    now = transfers.snapshot()
    return {"error": None, "same": bool((to_numpy(out) == np.arange(48.0).reshape(2, 1, 6, 4)).all()),
            "moved": now["h2d"] + now["d2h"] - before["h2d"] - before["d2h"]}
ring = cp.ContextParallelAttention(MPI.COMM_SELF, "ring", ranges=[[(0, 6)]])
def ring_pass():                     # my K block around a ring of one: sent to myself
    into, requests = ring._pass_kv((cp._wire(k),), 0)
    MPI.Request.Waitall(requests)
    return cp._arrived(into[0])
ulysses = cp.ContextParallelAttention(MPI.COMM_SELF, "ulysses", ranges=[[(0, 2), (2, 6)]])
to_heads = lambda: ulysses._seq_to_heads(k)   # tokens of every head -> every token of my heads
clean = {"ring": catch(ring_pass), "ulysses": catch(to_heads)}
from minidist.strict import CudaAwareComm   # COMM_SELF as a CUDA-aware MPI's stand-in
cp.staging.DIRECT, ring.comm = True, CudaAwareComm(MPI.COMM_SELF)
direct = catch(ring_pass)            # the direct path: device buffers, nothing through the host
direct["mpi_device"] = transfers.BYTES["mpi_device"]
cp.staging.DIRECT, ring.comm = False, MPI.COMM_SELF
cp._wire = lambda a: a               # planted: the device block handed to MPI's Isend as it is
cp.xp = np                           # planted: Ulysses' sequence reassembled by NumPy, on the host
print(json.dumps({"clean": clean, "direct": direct, "ring": catch(ring_pass),
                  "ulysses": catch(to_heads)}))
''')
    block = 48 * 8
    for name in ("ring", "ulysses"):                          # home to be sent, back once received
        assert said["clean"][name] == {"error": None, "same": True, "moved": 2 * block}, said
    # a CUDA-aware MPI reads the block sent and writes the one received: both counted there
    assert said["direct"] == {"error": None, "same": True, "moved": 0, "mpi_device": 2 * block}, said
    ring, ulysses = said["ring"], said["ulysses"]
    assert ring["error"] is not None and ring["error"].startswith(IMPLICIT), ring
    assert "ring_pass_start" in ring["where"], ring           # MPI's Isend given a device buffer
    assert ulysses["error"] is not None and ulysses["error"].startswith(IMPLICIT), ulysses
    assert "_seq_to_heads" in ulysses["where"], ulysses       # a device block written into host memory
