"""Pipeline parallelism: the GPT's layers cut into stages, one schedule run by every rank.

    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --schedule 1f1b --micro-batches 8

Stages. The blocks are cut into p*v virtual stages, as evenly as possible, the earlier
stages taking the extra layers (the later ones with extra_layers="last"); chunk c of
rank r holds virtual stage c*p + r (v = 1 unless interleaved). The first stage also holds the embeddings, the last one the final
layer norm, the head and the loss. The head is tied to the token embedding, which
lives on the first stage: the last stage keeps its own copy of wte, and after the
backwards the two copies' gradients are summed (one all-reduce between the first and
the last rank, Megatron's embedding group), so both take the same step and stay equal.

Communication. An F sends its output, b x s x h values, to the next virtual stage; a B
sends the gradient of its input, b x s x h values, to the previous one. So each
micro-batch crosses each of the p*v - 1 boundaries twice:
    bytes per step, whole pipeline = 2 (p v - 1) x b s h x itemsize x m
(docs/reference.md#pipeline-bubbles). Between two compute actions a rank calls
`exchange` once: it posts the receive the next action needs and the send of what the
last one made, and waits only for the receive. Sends never wait (they complete at the
end of the step), so a rank waits only for a message whose sender runs it before
anything that could wait on this rank: what schedules.validate proves for the whole
order. No deadlock, by construction.

Memory. A micro-batch's activations live on a stage from its F to its B (to its W in a
zero-bubble schedule); the executor counts them (`peak_live`) beside the simulator's.

Zero bubble (Qi et al. 2024, arXiv 2401.10241). A split schedule's B runs the backward
under `deferred_weight_grads()` (minidist/tensor.py), as PyTorch's pipelining runs its
input-gradient pass: every Linear and MatMul computes the gradient of its input only and
keeps its saved input and its output's gradient; the input gradient is sent at once.
The matching W runs those kept products (`run_weight_grads`): x^T grad for each weight,
the row sum of grad for each bias, added into .grad in the order the plain backward adds
them. Layer norm, the embeddings and the tied head (x @ wte.T, reached through a
transpose) stay whole in B: small next to the linears' GEMMs, which are most of W.
`history` keeps the last steps' action times, for the lesson's medians.

Mixture of experts (minidist/moe.py). An MoE block sits inside a stage with
its experts whole (no expert parallelism here). Each micro-batch's tokens are one
routing group: the stage's MoE layers route with n_groups = 1, whatever the config's
moe_groups, so the one-process run this equals is the same GPT with moe_groups = m (its
groups are contiguous batch rows, as micro-batches are; m x dp with data parallelism).
One process's loss is cross-entropy + sum over MoE layers of the mean over groups of
(balance + z); a micro-batch's share is scale x (its cross-entropy + every MoE layer's
aux of that micro-batch), scale = 1/m. The aux of a layer lives on its stage, so every
chunk with MoE blocks keeps, at its F, the sum of its layers' aux for that micro-batch
(MoEMLP.aux, before the next F overwrites it) and, at its B, runs one backward from
    (out * g).sum() + scale x aux        (the received g; a non-last stage)
    (loss + aux) x scale                 (the last stage)
one root, because a backward frees the graph it walks (a second backward through the
shared router nodes would be refused). d/d out of (out * g).sum() is g exactly, so the
gradient sent back is unchanged. Every schedule (interleaved too: each chunk adds its
own blocks') and the split of zb-h1 work unchanged: the router's x @ W_router is a
MatMul whose leaf weight W computes; the experts' stacked weights are used through
indexing, not a leaf Linear, so they stay whole in B. The reported loss adds every
stage's scale x aux to the last stage's cross-entropy: one float64 all-reduce over the
pipeline group in place of the broadcast (a dense model keeps the broadcast). MoEMLP
draws one dropout mask per block, where the dense MLP does, so dropout_calls_before
holds for MoE blocks too.

On a device (MINIDIST_DEVICE=cuda, or the strict double; this project's design). The token
ids cross to the device at stage 0's F, the targets at the last stage's; every message
between stages goes device -> host -> MPI -> host -> device (`message`, then the
receiver's to_device: 2 b s h x itemsize over PCIe per micro-batch per boundary and
direction, besides the wire), or straight from device memory where MPI is CUDA-aware
(comm/staging.py). wte's sum goes through the comm layer, staged the same way; the step's
losses come home in one copy at its end.
"""
import collections
import contextlib
import time

import numpy as np

from minidist import recompute
from minidist.backend import on_device, to_device, to_numpy, xp
from minidist.comm import all_reduce, broadcast, staging, stats
from minidist.comm.watchdog import waiting
from minidist.nn import Module, ModuleDict
from minidist.ops import cross_entropy
from minidist.optim import grad_norm_sq
from minidist.parallel import schedules
from minidist.parallel.strategy import Strategy
from minidist.plan.traffic import pp_sent
from minidist.rng import DropoutRNG
from minidist.tensor import Tensor, deferred_weight_grads, run_weight_grads


HISTORY = 64                # steps whose action times the executor keeps (lesson 04's medians)


class PipelineError(ValueError):
    """A pipeline that cannot be built (more stages than layers, chunks that do not divide)."""


EXTRA_LAYERS = ("first", "last")


def split_layers(n_layer, n_stages, extra_layers="first"):
    """[(lo, hi)] layer ranges of each stage; n_layer % n_stages of them take one more:
    the first stages (extra_layers="first", the default) or the last ones ("last").

    "last" spares stage 0, which already holds the embedding and, under 1F1B, the most
    micro-batches in flight (p of them); the last stage holds only one.
    """
    if n_stages > n_layer:
        raise PipelineError(f"{n_stages} pipeline stages but only {n_layer} layers: every stage needs "
                            f"at least one layer (use --n-layer >= {n_stages} or fewer stages)")
    if extra_layers not in EXTRA_LAYERS:
        raise PipelineError(f"extra_layers must be one of {EXTRA_LAYERS}, not {extra_layers!r}")
    base, extra = divmod(n_layer, n_stages)
    out, lo = [], 0
    for s in range(n_stages):
        more = s < extra if extra_layers == "first" else s >= n_stages - extra
        hi = lo + base + more
        out.append((lo, hi))
        lo = hi
    return out


def dropout_calls_before(layer):
    """How many dropout masks the whole GPT draws before block `layer`: the embedding's,
    then three per block (attention probabilities, attention output, MLP output). A stage
    starts its micro-batch's DropoutRNG there, so its masks are the ones one process draws."""
    return 1 + 3 * layer


# ----------------------------------------------------------------------------- the stage model

class PipelineGPT(Module):
    """This rank's chunks of a whole GPT, under the single-process parameter names.

    Every rank builds the whole GPT from the seed (same weights everywhere) and keeps
    the blocks of its virtual stages, the embeddings if it holds stage 0, ln_f and the
    tied head if it holds the last one.

    `full` may be the single-process GPT or a model already cut another way, such as
    tensor parallelism's (3D parallelism: TP inside each stage). A model with its own
    `embed(idx, rng)` and `head(x, targets)` lends them to the first and last stage,
    collectives included; the blocks are called as they are, on the whole (B, T, C)
    activation that travels between stages.
    """

    def __init__(self, full, p, rank, v=1, extra_layers="first"):
        self.config, self.p, self.rank, self.v = full.config, p, rank, v
        n = p * v
        self.ranges = split_layers(full.config.n_layer, n, extra_layers)
        self.stages = [schedules.stage_of(rank, c, p) for c in range(v)]
        self.first, self.last = 0 in self.stages, n - 1 in self.stages
        tr = full.transformer
        mods = {"h": ModuleDict(**{str(i): tr.h[i] for s in self.stages for i in range(*self.ranges[s])})}
        if self.first:
            mods.update(wte=tr.wte, wpe=tr.wpe)
            if hasattr(tr, "drop"):
                mods.update(drop=tr.drop)
        if self.last:
            mods.update(wte=tr.wte, ln_f=tr.ln_f)   # the head: wte's copy on the last stage
        self.transformer = ModuleDict(**mods)
        # bound methods, not Modules: the whole model's parameters stay out of this stage's
        self._ends = (getattr(full, "embed", None), getattr(full, "head", None))
        # MoE layers per chunk (an mlp with an `aux`); each micro-batch is one routing group
        self.moe = [[b.mlp for b in self.blocks(c) if hasattr(b.mlp, "aux")] for c in range(v)]
        for layer in (mlp for chunk in self.moe for mlp in chunk):
            if hasattr(layer, "n_groups"):
                layer.n_groups = 1
        policy = getattr(full, "recompute", None)      # as the whole model was set, k included
        self.set_recompute(policy.name if policy else "none", policy.k if policy else None)

    @property
    def pipeline_stages(self):
        """p, the stages the model is cut into, for a checkpoint's layout name."""
        return self.p

    @property
    def tensor_parallel(self):
        """The TensorParallelGPT this stage was cut from (its ends' owner), else None: how
        its parameters are sharded, for a checkpoint (minidist/checkpoint/layouts.py)."""
        for end in self._ends:
            owner = getattr(end, "__self__", None)
            if owner is not None and getattr(owner, "tensor_parallel", None) is owner:
                return owner
        return None

    def blocks(self, c=None):
        """This rank's blocks, in order (c: chunk c's only)."""
        stages = self.stages if c is None else [self.stages[c]]
        return [self.transformer.h[str(i)] for s in stages for i in range(*self.ranges[s])]

    def set_recompute(self, policy="none", k=None):
        """Activation recomputation for this stage's blocks (minidist/recompute.py): full,
        every-k (segments of k blocks within each chunk; k defaults to round(sqrt(L_r)) of
        this rank's L_r blocks) or selective. The backward of a checkpoint starts from any
        gradient, the non-scalar one the next stage sends included. With experts, only
        none and selective, as GPT.set_recompute: a checkpoint's forward runs without a
        graph, so the MoE aux losses inside it would get no gradient."""
        if getattr(self.config, "n_expert", 0) > 0 and policy in ("full", "every-k"):
            raise ValueError(f"recompute {policy!r} with mixture of experts: the checkpoint's forward runs "
                             f"without a graph, so the MoE auxiliary losses inside it would get no gradient "
                             f"(use 'none' or 'selective')")
        recompute.set_policy(self, policy, k, blocks=self.blocks())
        return self

    def forward_chunk(self, c, x, targets, rng):
        """Virtual stage c*p + rank on one micro-batch: idx or activations in; activations or the loss out."""
        s, tr = self.stages[c], self.transformer
        embed, head = self._ends
        if s == 0 and embed is not None:
            x = embed(to_device(x), rng)                  # the token ids cross here; (B, T, C)
        elif s == 0:
            B, T = x.shape
            x = tr.drop(tr.wte(to_device(x)) + tr.wpe(xp.arange(T)), rng)    # (B, T, C)
        x = recompute.run_blocks(self.recompute, self.blocks(c), x, rng)     # this chunk's blocks
        if s == self.p * self.v - 1 and head is not None:
            return head(x, to_device(targets))[1]
        if s == self.p * self.v - 1:
            logits = tr.ln_f(x) @ tr.wte.weight.T                               # (B, T, vocab)
            return cross_entropy(logits, to_device(targets))
        return x

    def chunk_aux(self, c):
        """The last forward's auxiliary losses of chunk c's MoE layers, balance + z summed
        over them (a Tensor), or None when the chunk has no MoE block."""
        total = None
        for layer in self.moe[c]:
            aux = layer.aux["balance"] + layer.aux["z"]
            total = aux if total is None else total + aux
        return total

    def configure_optimizers(self, weight_decay, lr, betas=(0.9, 0.95), eps=1e-8):
        from minidist.model import GPT
        return GPT.configure_optimizers(self, weight_decay, lr, betas, eps)


# ----------------------------------------------------------------------------- one exchange

def exchange(comm, send=None, recv=None):
    """Post the receive the next action needs and the send of what the last one made.

    send: None or (array, dest, tag); recv: None or (shape, dtype, source, tag). The
    receive is posted first, then the send, and only the receive is waited for:
    a neighbour doing the same towards this rank (1F1B's steady state: one sends
    activations forward while the other sends gradients back) finds its receive
    posted. Two blocking sends facing each other would each wait for the other's
    receive. Returns (received array or None, send request or None); the caller waits
    for the send's request before reusing or dropping the array.

    On a device (this project's design, as comm/staging.py's): the array to send is what
    `message` made of it and the receive lands in host memory, unless MPI reads and
    writes device memory itself (CUDA-aware: staging.DIRECT), when both are device buffers.
    """
    got = rreq = sreq = None
    if recv is not None:
        shape, dtype, source, tag = recv
        got = (xp if staging.DIRECT else np).empty(shape, dtype)
        rreq = comm.Irecv(staging.hand_to_mpi(got), source, tag)
    if send is not None:
        x, dest, tag = send
        sreq = comm.Isend(staging.hand_to_mpi(x), dest, tag)
    if rreq is not None:
        rreq.Wait()
    return got, sreq


def message(x):
    """An activation or its gradient as exchange sends it: a contiguous host copy (device to
    host, counted; the array itself on the CPU), or, where MPI reads device memory
    (staging.DIRECT), the device array. The receiver's to_device is the matching copy."""
    if staging.DIRECT:
        return xp.ascontiguousarray(x)
    return np.ascontiguousarray(to_numpy(x))


def ids_on_device(batches, ids=True, targets=True):
    """train_step's micro-batches [(x, y, rng)] with the token ids x (ids: stage 0 reads them)
    and the targets y (targets: the last stage's) moved to the device in one copy: every
    micro-batch's rows stacked on the host, the device array cut back at row bounds the
    host knows. One transfer a step where there were m (fewer, larger copies: each has a
    latency). Batches already on the device, or whose parts cannot stack, stay as they are."""
    cols = [k for k, want in ((0, ids), (1, targets)) if want]
    parts = [b[k] for k in cols for b in batches]
    if not parts or any(on_device(a) for a in parts):
        return batches
    parts = [np.asarray(a) for a in parts]
    if len({(a.dtype, a.shape[1:]) for a in parts}) > 1 or any(a.ndim == 0 for a in parts):
        return batches
    whole = to_device(np.concatenate(parts))                            # the one h2d copy
    ends = np.cumsum([0] + [len(a) for a in parts]).tolist()            # host ints: the cuts
    pieces = iter([whole[lo:hi] for lo, hi in zip(ends, ends[1:])])
    out = [list(b) for b in batches]
    for k in cols:
        for b in out:
            b[k] = next(pieces)
    return [tuple(b) for b in out]


# ----------------------------------------------------------------------------- the executor

class PipelineParallel(Strategy):
    """The `dp` slot of train_step for a pipeline: runs the schedule, then syncs.

    forward_backward(model, batches, scale) replaces train_step's loop over micro-batches
    (every forward and backward of the step, in this rank's order); sync() sums the tied
    embedding's two copies and averages over data-parallel replicas; grad_norm_sq()
    adds every stage's part of the squared gradient norm (wte counted once).
    """
    owns_schedule = True

    def __init__(self, model, comm, schedule_name, m, dp=None):
        from mpi4py import MPI
        self.model, self.comm, self.dp, self.m = model, comm, dp, m
        p, v = model.p, model.v
        self.name = schedule_name
        self.schedule = schedules.build(schedule_name, p, m, v)
        schedules.validate(self.schedule, p, m, v)
        self.actions = self.schedule[comm.Get_rank()]
        self.split = any(a[0] == "W" for a in self.actions)
        ends = comm.Get_rank() in (0, p - 1)       # Megatron's embedding group: first and last stage
        self.embed_comm = None                     # a collective on the pipeline group: every rank splits
        if p > 1:
            group = comm.Split(0 if ends else MPI.UNDEFINED, comm.Get_rank())
            self.embed_comm = group if ends else None
        self.events, self.peak_live = [], 0
        self.history = collections.deque(maxlen=HISTORY)   # the last steps' events

    # -- where messages go
    def _neighbour(self, c, step):
        """(pipeline rank, chunk) of the virtual stage `step` (+1 or -1) away from my chunk c."""
        return schedules.place(self.model.stages[c] + step, self.model.p)

    def _tag(self, mb, stage, backward):
        return 2 * (mb * self.model.p * self.model.v + stage) + backward

    def _recv_spec(self, action, batches):
        """What `action` must receive first: (shape, dtype, source, tag), or None."""
        op, mb, c = action
        s, n = self.model.stages[c], self.model.p * self.model.v
        if (op == "F" and s == 0) or (op == "B" and s == n - 1) or op == "W":
            return None
        shape = batches[mb][0].shape + (self.model.config.n_embd,)
        src = self._neighbour(c, -1 if op == "F" else +1)[0]
        return shape, np.dtype(self.model.config.dtype), src, self._tag(mb, s, op == "B")

    # -- one step
    def forward_backward(self, model, batches, scale):
        if len(batches) != self.m:
            raise PipelineError(f"the schedule is for {self.m} micro-batches, the step has {len(batches)}")
        n, split = model.p * model.v, self.split
        batches = ids_on_device(batches, model.first, model.last)     # one copy, not one per micro-batch
        saved, held, pending, losses, auxes = {}, {}, [], [], []
        outgoing, live, self.events, self.peak_live = None, 0, [], 0
        for action in self.actions + [None]:
            spec = None if action is None else self._recv_spec(action, batches)
            with waiting(f"pipeline exchange before {action}"):
                got, req = exchange(self.comm, outgoing, spec)
            if req is not None:
                pending.append((req, outgoing[0]))
                stats.add("send", sent=outgoing[0].nbytes, messages=1, calls=1)
            if got is not None:
                stats.add("recv", recv=got.nbytes, calls=1)
            outgoing = None
            if action is None:
                break
            op, mb, c = action
            s = model.stages[c]
            t0 = time.perf_counter()
            if op == "F":
                x_in = None if s == 0 else Tensor(to_device(got), requires_grad=True)
                x, y, rng = batches[mb]
                r = DropoutRNG(rng.seed, rng.step, rng.sample_ids)
                r.calls = 0 if s == 0 else dropout_calls_before(model.ranges[s][0])
                out = model.forward_chunk(c, x if s == 0 else x_in, y, r)
                aux = model.chunk_aux(c) if hasattr(model, "chunk_aux") else None   # before the next F
                saved[(mb, c)] = (x_in, out, aux)
                if aux is not None:
                    auxes.append(aux.data)          # on the device: they come home together below
                live += 1
                self.peak_live = max(self.peak_live, live)
                if s == n - 1:
                    losses.append(out.data)
                else:
                    dest = self._neighbour(c, +1)[0]
                    outgoing = (message(out.data), dest, self._tag(mb, s + 1, False))
            elif op == "B":
                x_in, out, aux = saved.pop((mb, c))
                with deferred_weight_grads() if split else contextlib.nullcontext() as later:
                    if s == n - 1:
                        ((out if aux is None else out + aux) * scale).backward()
                    elif aux is None:
                        out.backward(to_device(got))
                    else:                           # one root: the graph is freed as it is walked
                        ((out * Tensor(to_device(got, out.dtype))).sum() + aux * scale).backward()
                if split:                           # the weight gradients wait for W
                    held[(mb, c)] = later
                else:
                    live -= 1
                if s > 0:
                    dest = self._neighbour(c, -1)[0]
                    outgoing = (message(x_in.grad), dest, self._tag(mb, s - 1, True))
            else:                                   # W: the weight gradients B left for later
                run_weight_grads(held.pop((mb, c)))
                live -= 1                           # what W held (saved inputs, output grads) is freed
            self.events.append((op, mb, c, t0, time.perf_counter()))   # one clock for all ranks of a node
        self.history.append(self.events)
        for req, _ in pending:                      # every send completes before the step ends
            with waiting("pipeline sends of this step"):
                req.Wait()
        # the step's losses (and MoE aux losses) come home in one copy, summed in order
        total, aux_total = 0.0, 0.0
        if losses or auxes:
            home = to_numpy(xp.stack(losses + auxes))
            for v in home[:len(losses)]:
                total += float(v) * scale
            for v in home[len(losses):]:
                aux_total += float(v) * scale
        # the loss lives on the last stage; every stage reports it (one float64)
        if getattr(model.config, "n_expert", 0) > 0:    # + every stage's MoE aux losses
            return float(all_reduce(self.comm, np.array([total + aux_total]))[0])
        last = schedules.place(n - 1, model.p)[0]
        return float(broadcast(self.comm, np.array([total]), root=last)[0])

    @property
    def durations(self):
        """{op: [seconds of each such action]} over the steps in `history`."""
        out = {op: [] for op in schedules.OPS}
        for events in self.history:
            for op, _, _, t0, t1 in events:
                out[op].append(t1 - t0)
        return out

    # -- after the backwards
    def backward_context(self, last):
        raise RuntimeError("a pipeline runs its own backwards: train_step calls forward_backward")

    def sync(self):
        """Sum wte's gradient over its two copies (first and last stage), then the DP average."""
        if self.embed_comm is not None:
            w = self.model.transformer.wte.weight
            g = w.grad if w.grad is not None else xp.zeros_like(w.data)
            w.grad = all_reduce(self.embed_comm, g)      # a device array stays one (comm/staging.py)
        if self.dp is not None:
            self.dp.sync()

    def grad_norm_sq(self, params):
        """The whole model's squared gradient norm: every stage's part, wte counted once."""
        m = self.model
        skip = {id(m.transformer.wte.weight)} if m.last and not m.first else set()
        sq = grad_norm_sq([p for p in params if id(p) not in skip])
        return float(all_reduce(self.comm, np.array([sq]))[0]) if m.p > 1 else sq


def expected_p2p_bytes(model, batch_rows, itemsize):
    """Bytes this rank sends point-to-point in one step: plan.traffic.pp_sent of this
    stage's virtual stages (b s h per micro-batch per boundary, forward from every chunk
    that is not the last stage, backward from every chunk that is not the first)."""
    return pp_sent(model.stages, model.p * model.v, batch_rows, model.config.block_size, model.config.n_embd,
                   itemsize)
