"""Lesson 11's layouts: one GPT trained under data parallelism, ZeRO 1-3, tensor
parallelism or TP x PP, built the way the earlier lessons build them, with one training
loop for all, so that a checkpoint saved under one can be resumed under another.

    run = build("zero3", comm, cfg, seed)       # model, optimizer, dp slot, zero, batch rows
    losses = train(run, data, batch, start, stop, lr, clip, seed)
"""
import numpy as np
from mpi4py import MPI

LAYOUTS = ("single", "dp", "zero1", "zero2", "zero3", "tp", "pp", "tp2pp2")


class Run:
    def __init__(self, name, comm, model, opt, slot, zero=None, whole_batch=False, micro=1):
        self.name, self.comm, self.model, self.opt, self.slot = name, comm, model, opt, slot
        self.zero, self.whole_batch, self.micro = zero, whole_batch, micro

    @property
    def optimizer(self):
        """What train_step steps: ZeRO and 3D are their own optimizer."""
        return self.slot if self.zero is not None or self.name == "tp2pp2" else self.opt

    def describe(self):
        n = self.comm.Get_size()
        return {"single": "one process", "dp": f"data parallelism over {n} ranks",
                "zero1": f"ZeRO-1 over {n} ranks", "zero2": f"ZeRO-2 over {n} ranks",
                "zero3": f"ZeRO-3 (FSDP) over {n} ranks", "tp": f"tensor parallelism over {n} ranks",
                "pp": f"a pipeline of {n} stages (1F1B, {self.micro} micro-batches)",
                "tp2pp2": "tensor parallelism 2 x pipeline 2 (1F1B, 2 micro-batches)"}[self.name]


def problem(name, world, cfg):
    """Why layout `name` cannot run on `world` ranks with this model (None when it can)."""
    if name not in LAYOUTS:
        return f"unknown layout {name!r}; the layouts are {', '.join(LAYOUTS)}"
    if name == "tp2pp2" and world != 4:
        return "tp2pp2 needs exactly 4 ranks (2 x 2)"
    if name == "tp2pp2" and (cfg.n_head % 2 or cfg.n_layer < 2):
        return "tp2pp2 needs an even --n-head and at least 2 layers"
    if name == "tp" and cfg.n_head % world:
        return f"tp over {world} ranks needs --n-head divisible by {world}"
    if name == "pp" and cfg.n_layer < world:
        return f"a pipeline of {world} stages needs --n-layer {world} or more"
    return None


def build(name, comm, cfg, seed, lr, offload=None, offload_dir=None):
    """A fresh run of layout `name` on `comm` from the given seed's weights. offload="disk":
    the ZeRO layouts keep AdamW's state (stage 3: the shards too) and the reduced gradient
    partition in files (parallel/offload.py)."""
    from minidist.model import GPT
    from minidist.parallel.data_parallel import NaiveDataParallel
    full = GPT(cfg, seed=seed)
    if name in ("single", "dp"):
        opt = full.configure_optimizers(0.1, lr)
        return Run(name, comm, full, opt, NaiveDataParallel(full, comm) if comm.Get_size() > 1 else None)
    if name.startswith("zero"):
        from minidist.parallel import fsdp
        from minidist.parallel.zero import ZeRO
        opt = full.configure_optimizers(0.1, lr)
        kw = {"offload": offload, "offload_dir": offload_dir} if offload else {}
        zero = fsdp.FSDP(full, opt, comm, **kw) if name == "zero3" else ZeRO(full, opt, comm, int(name[-1]), **kw)
        if offload == "disk":         # the reduced gradients go to a file too, as ZeRO-Offload's to CPU
            zero.offload.offload_grads()
        return Run(name, comm, full, opt, zero, zero)
    if name == "tp":
        from minidist.parallel.tp_model import TensorParallelGPT, TensorParallelSync
        model = TensorParallelGPT(full, comm)
        return Run(name, comm, model, model.configure_optimizers(0.1, lr), TensorParallelSync(model),
                   whole_batch=True)
    if name == "pp":
        from minidist.parallel.pipeline_parallel import PipelineGPT, PipelineParallel
        stage = PipelineGPT(full, comm.Get_size(), comm.Get_rank())
        m = 2 * comm.Get_size()
        return Run(name, comm, stage, stage.configure_optimizers(0.1, lr),
                   PipelineParallel(stage, comm, "1f1b", m), whole_batch=True, micro=m)
    from minidist.comm import ProcessGrid
    from minidist.parallel.parallel_3d import Parallel3D, build_stage
    grid = ProcessGrid(tp=2, pp=2, dp=1, comm=comm)
    stage, tp_model = build_stage(full, grid)
    opt = GPT.configure_optimizers(stage, 0.1, lr)
    return Run(name, comm, stage, opt, Parallel3D(stage, tp_model, grid, "1f1b", 2, opt), whole_batch=True, micro=2)


def train(run, data, batch, start, stop, lr, clip, seed):
    """Steps [start, stop): the mean loss of each step over the whole batch."""
    from minidist.train import micro_batches, train_step
    from minidist import equivalence, transfers
    comm, size, rank = run.comm, run.comm.Get_size(), run.comm.Get_rank()
    losses, moved = [], 0
    for step in range(start, stop):
        x, y = data.get_batch("train", batch, step)
        if run.whole_batch:
            rows = slice(0, batch)
        else:
            per = batch // size
            rows = slice(rank * per, (rank + 1) * per)
        before = transfers.snapshot()          # host<->device bytes of the step alone (0 on the CPU)
        loss, _ = train_step(run.model, run.optimizer, micro_batches(x[rows], y[rows], step, seed, run.micro, rows.start),
                             lr, clip, dp=run.slot)
        moved += equivalence.host_device_bytes(before)
        if not run.whole_batch and size > 1:
            total = np.empty(1)
            comm.Allreduce(np.array([loss]), total, op=MPI.SUM)
            loss = float(total[0]) / size
        losses.append(float(loss))
    equivalence.record_run(moved, stop - start, strategy=run.name != "single")
    return losses
