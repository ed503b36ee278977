"""Expert parallelism (GShard, Lepikhin et al. 2020, arXiv 2006.16668; DeepSpeed-MoE,
Rajbhandari et al. 2022, arXiv 2201.05596): the E experts of each MoE layer are spread
over an ep group of ranks, E/ep each; tokens travel to their experts and back.

    mpirun -n 4 python -m pytest -q --only-mpi tests/mpi/test_expert_parallel.py

The ep group is carved out of the data-parallel ranks, as DeepSpeed-MoE and Megatron do:
every rank trains on its own slice of the global batch and holds the whole dense model
(attention, norms, embeddings, the router), but only experts [r E/ep, (r+1) E/ep) of
each MoE layer. A rank's tokens are one routing group (minidist/moe.py), so one process
running the same GPT with moe_groups = the number of data-parallel ranks, over the
same global batch, routes every token identically: that is what the tests compare with.

One MoE layer, on rank r with n local tokens x (n, C):

    router (replicated)   probs, experts, keep = gates + select(one group, drop policy)
    dispatch all-to-all   each kept (token, choice) row goes to its expert's owner,
                          ordered by expert, then token, then choice
    experts               the owner runs each of its experts on the rows it received
    combine all-to-all    the outputs go back the way they came, in the same order
    combine               y[t] = sum over t's kept choices of gate weight x output

Both all-to-alls are minidist.comm.all_to_all_v (counts first, then the rows, on
point-to-point messages) inside an autograd Function whose backward is the reverse
all-to-all of the gradient: four all-to-alls per MoE layer per step. Before the
dispatch, each rank tells each owner how many of its rows are for each of the owner's
experts (E/ep int64 per pair, counted under "expert_counts", apart from the rows).

Bytes each rank sends per MoE layer per step (counted under "all_to_all"; C the width):

    dispatch fwd + combine bwd   2 x (rows I send to other ranks)       x C x itemsize
    combine fwd + dispatch bwd   2 x (rows I get from other ranks)      x C x itemsize

ExpertParallelMoE.comm_bytes holds both, measured and by this formula, for every call.

On a device the rows stay device arrays: the all-to-alls hand them to minidist.comm,
which stages them through host buffers (counted) or gives them to a CUDA-aware MPI; the
routing runs on the host as in minidist/moe.py (the gates home, the rows' tokens and
choices back, once per layer; the order of the rows an owner received, to run them
expert by expert, one more copy), and the counts exchanged before the rows are host data.

pad_to_capacity=True sends what GShard, DeepSpeed-MoE and Megatron-Core with
--moe-pad-expert-input-to-capacity send: each expert's slice of the buffer padded with
zero rows to `capacity`, an (E, capacity, C) buffer of which (ep-1)/ep leaves the rank,
whatever the routing (plan.traffic.moe_padded_sent, per all-to-all). The counts still
go first here, so that the owner runs its experts on the real rows only (this project's
choice; GShard's experts compute the zero rows too, and their combine weight of 0 drops
them). Needs a capacity (not dropless).

Gradients: the dense parameters (the router included) are averaged over every
data-parallel rank, as plain data parallelism does. An expert's gradient already holds
the contributions of every ep rank's tokens (the backward all-to-all brought them home),
the sum of ep ranks' local-loss gradients; it is summed over the ranks that hold the
same expert (the dp_outer copies when world = dp_outer x ep; nobody when world = ep)
and divided by the number of data-parallel ranks, which makes it the gradient of the
mean loss. Memory: each rank keeps E/ep of the expert weights, gradients and AdamW state.

With tensor parallelism (tests/mpi/test_moe_tensor_parallel.py):

    grid = ProcessGrid(tp=2)                                  # dp = world / 2
    model = TensorParallelGPT(GPT(cfg), grid.tp_comm)         # cfg.moe_groups = grid.dp
    ep = expert_parallel(model, grid.dp_comm, grid.dp_comm)   # ep = dp
    sync = TensorParallelSync(model, dp=ep)

The dense parts (attention, dense MLPs, embeddings, head) are cut as TensorParallelGPT
cuts them; an MoE block's MLP is not cut (minidist/parallel/tp_model.py): plain tensor
parallelism keeps ln_2's output whole on every TP rank, so the router and the experts
act on the same replicated activations there, and the TP ranks of one replica compute
the same routing and the same expert outputs. The experts are spread over an ep group
carved out of the data-parallel ranks, one per TP rank: tp rank i of every replica
forms ep group i (the grid's dp_comm of tp rank i; ep = dp here, each replica's tokens
one routing group, so the one-process reference is the same MoE GPT with moe_groups =
dp). Each TP rank runs the all-to-alls over its own ep group with the same rows as its
TP partner: redundant work, the simple way. Megatron-Core does otherwise: with EP and TP
it requires sequence parallelism, so each TP rank enters the MoE layer with its own
slice of the tokens, and its "MoE Parallel Folding" folds the attention's TP ranks into
the experts' EP x expert-TP grid (--expert-tensor-parallel-size 1 gives the experts no
TP), so no expert runs twice (megatron/core/transformer/moe/README.md of NVIDIA/Megatron-LM).

Gradients under TP: the TP shards as TensorParallelSync leaves them (nothing to do
without sequence parallelism), every dense parameter (shards, replicated ones and the
router) averaged over the data-parallel ranks (the dp_comm of this TP rank), the experts
summed over the ranks that hold the same ones (none when ep = dp) and divided by dp, as
above. Nothing is summed over the TP pair: each TP rank computed the whole gradient of
the router (it sees the replicated input, and the auxiliary losses are added alike on
both) and of its experts; a sum would double them. The clipping norm
(TensorParallelSync.grad_norm_sq) counts each shard once (summed over TP), each
replicated parameter and the router once (this rank's copy), and each expert once
(expert_grad_norm_sq: summed over this TP rank's ep group only).
"""

import numpy

from minidist import ops
from minidist.backend import to_device, to_numpy, xp
from minidist.comm import all_reduce, all_to_all_v, stats
from minidist.moe import (MoEMLP, StackedLinear, balance_loss, combine_weights, expert_capacity,
                          expert_mlp, gates, kept_rows, scatter_add_rows, select, z_loss)
from minidist.nn import Parameter
from minidist.parallel.data_parallel import average_gradients
from minidist.parallel.strategy import Strategy
from minidist.tensor import Function, Tensor

# ----------------------------------------------------------------------------- the all-to-all Function


def _exchange(comm, rows, send_counts, recv_counts, log, what, pad=None):
    """all_to_all_v of the (m, C) rows: send_counts (ranks, experts per rank) cuts them in
    consecutive chunks, rank by rank and within a rank expert by expert; the received
    chunks are joined in rank order. pad: every expert's block is sent padded with zero
    rows to `pad` rows and the padding dropped on arrival (recv_counts says where).
    Logs the bytes sent, measured and by formula."""
    send_counts, recv_counts = numpy.asarray(send_counts), numpy.asarray(recv_counts)
    bounds = numpy.concatenate([[0], numpy.cumsum(send_counts.sum(1))]).tolist()   # host ints
    rank = comm.Get_rank()
    chunks = [rows[bounds[j]:bounds[j + 1]] for j in range(comm.Get_size())]      # rows' kind
    if pad is not None:
        chunks = [_pad(c, counts, pad) for c, counts in zip(chunks, send_counts)]
    with stats.measure() as m:
        got = all_to_all_v(comm, chunks)                     # device chunks: staged by comm
    if pad is not None:
        got = [_unpad(g, counts, pad) for g, counts in zip(got, recv_counts)]
    formula = sum(c.nbytes for j, c in enumerate(chunks) if j != rank)
    log.append((what, m.bytes_sent("all_to_all"), formula))
    return xp.concatenate(got, axis=0)


def _pad(chunk, counts, pad):
    """chunk: counts[0] rows for the first expert, counts[1] for the next, ... -> each
    block followed by zero rows up to `pad`: (len(counts) x pad, C), on the device."""
    out = xp.zeros((len(counts) * pad,) + chunk.shape[1:], chunk.dtype)
    at = 0
    for i, c in enumerate(counts.tolist()):                   # host ints
        out[i * pad:i * pad + c] = chunk[at:at + c]
        at += c
    return out


def _unpad(chunk, counts, pad):
    """The inverse of _pad: the first counts[i] rows of every block of `pad` rows."""
    return xp.concatenate([chunk[i * pad:i * pad + c] for i, c in enumerate(counts.tolist())],
                          axis=0)


class AllToAllRows(Function):
    """all_to_all_v forward, the reverse all_to_all_v backward.

    forward: rows (m, C), the first send_counts[0].sum() for rank 0, the next
    send_counts[1].sum() for rank 1, ... (send_counts (ranks, experts per rank)); returns
    the rows received, rank 0's first: (recv_counts.sum(), C). pad: see _exchange.
    backward: the gradient of each received row goes back to the rank that sent it, which
    puts it where the row came from: the same exchange with the counts swapped.
    """
    @staticmethod
    def forward(ctx, rows, comm, send_counts, recv_counts, log, name, pad):
        ctx.comm, ctx.log, ctx.name, ctx.pad = comm, log, name, pad
        ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
        return _exchange(comm, rows, send_counts, recv_counts, log, f"{name} forward", pad)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(ctx.comm, grad, ctx.recv_counts, ctx.send_counts, ctx.log, f"{ctx.name} backward",
                         ctx.pad)


def all_to_all_rows(rows, comm, send_counts, recv_counts, log, name, pad=None):
    return AllToAllRows.apply(rows, comm=comm, send_counts=send_counts, recv_counts=recv_counts,
                              log=log, name=name, pad=pad)

# ----------------------------------------------------------------------------- the layer


class ExpertParallelMoE(MoEMLP):
    """An MoEMLP holding experts [lo, hi) of E, whose tokens travel to their experts.

    Built from a single-process MoEMLP (same router, the slice [lo, hi) of its experts), so
    both start equal. Its forward routes the local tokens as ONE group, whatever n_groups
    says: the rank is the group. self.aux as MoEMLP's (this rank's group); comm_bytes:
    [(which all-to-all, bytes sent measured, by formula)] since the last reset.
    pad_to_capacity: send the padded (E, capacity, C) buffer (module docstring).
    """

    def held_experts(self):
        """(lo, hi, E): this rank holds experts [lo, hi) of E, stacked on the first axis
        of c_fc's and c_proj's tensors (what a checkpoint saves of them)."""
        return self.lo, self.hi, self.n_expert

    def __init__(self, moe, ep_comm, pad_to_capacity=False):
        E, ep, r = moe.n_expert, ep_comm.Get_size(), ep_comm.Get_rank()
        if E % ep:
            raise ValueError(f"expert parallelism spreads E experts evenly over the ep group: "
                             f"E = {E} is not a multiple of the ep size {ep}")
        self.ep_comm, self.per_rank = ep_comm, E // ep
        self.lo, self.hi = r * self.per_rank, (r + 1) * self.per_rank
        self.router = moe.router                                        # replicated
        self.c_fc, self.c_proj = _slice(moe.c_fc, self.lo, self.hi), _slice(moe.c_proj, self.lo, self.hi)
        self.dropout = moe.dropout
        self.n_expert, self.top_k = E, moe.top_k
        self.capacity_factor, self.n_groups = moe.capacity_factor, 1
        self.alpha, self.z_coef = moe.alpha, moe.z_coef
        self.drop_policy = moe.drop_policy
        if pad_to_capacity and self.capacity_factor is None:
            raise ValueError("padding to capacity needs a capacity: dropless routing has no bound to pad to")
        self.pad_to_capacity = pad_to_capacity
        self.aux, self.comm_bytes = None, []

    def local_expert(self, x_rows, e):
        """Global expert e (lo <= e < hi) on x_rows (n, C), from this rank's slice."""
        i = e - self.lo
        return expert_mlp(x_rows, i, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)

    def forward(self, x, rng=None, n_groups=None):
        """x (B, T, C), this rank's tokens -> y (B, T, C); one routing group."""
        B, T, C = x.shape
        y, self.aux = self.route_group(x.reshape(B * T, C))
        return self.dropout(y.reshape(B, T, C), rng)

    def route_group(self, xg):
        n, C = xg.shape
        E, k, ep, per = self.n_expert, self.top_k, self.ep_comm.Get_size(), self.per_rank
        probs, logits = gates(xg, self.router.weight)                  # (n, E) each
        capacity = expert_capacity(n, k, E, self.capacity_factor)
        experts, keep = select(to_numpy(probs.data), k, capacity, self.drop_policy)
        pad = capacity if self.pad_to_capacity else None
        w = combine_weights(probs, experts, keep, k)                   # (n, k)
        # the kept choices, ordered by expert, then token, then choice: owner by owner (host)
        tok, slot, per_expert = kept_rows(experts, keep, E)            # (rows,) (rows,) (E,)
        at = to_device(numpy.stack([tok, slot]))                       # (2, rows) on the device
        send = per_expert.reshape(ep, per)                              # (ep, E/ep) by owner
        # tell each owner how many rows of mine each of its experts gets (apart from the rows)
        with stats.counting("expert_counts"):
            got = numpy.stack(all_to_all_v(self.ep_comm, list(send)))  # (ep, E/ep) by sender
        # dispatch: my rows to their experts' owners; I get theirs for my experts
        received = all_to_all_rows(xg[at[0]], self.ep_comm, send, got, self.comm_bytes,
                                   "dispatch", pad)                     # (sum got, C)
        out = self._run_experts(received, got)                          # (sum got, C)
        # combine: the outputs go back to the ranks the rows came from, in the same order
        back = all_to_all_rows(out, self.ep_comm, got, send, self.comm_bytes,
                               "combine", pad)                          # (len(tok), C)
        if len(tok):
            weighted = back * w[at[0], at[1]].reshape(len(tok), 1)     # weighted by the gate
            y = scatter_add_rows(weighted, at[0], n)                    # (n, C)
        else:
            y = Tensor(xp.zeros(xg.shape, xg.dtype)) + back.sum() * 0.0  # keeps the combine in the graph
        aux = dict(balance=balance_loss(probs, experts, E, k, self.alpha), z=z_loss(logits, self.z_coef),
                   tokens_per_expert=numpy.bincount(experts[keep], minlength=E),
                   routed_per_expert=numpy.bincount(experts.ravel(), minlength=E))
        aux["dropped"] = int(aux["routed_per_expert"].sum() - aux["tokens_per_expert"].sum())
        return y, aux

    def _run_experts(self, received, got):
        """Each of my experts on its rows. received: sender by sender, within a sender my
        experts in order; got (ep, E/ep) the counts. Returns the outputs in received order."""
        starts = numpy.concatenate([[0], numpy.cumsum(got.ravel())]).astype(int).reshape(-1)
        order = []                                                      # received rows, expert by expert
        for i in range(self.per_rank):
            order += [numpy.arange(starts[s * self.per_rank + i], starts[s * self.per_rank + i + 1])
                      for s in range(got.shape[0])]
        order = numpy.concatenate(order).astype(numpy.int64)            # host: from the counts
        if not len(order):
            return received                                             # no rows: nothing to run
        # the permutation and its inverse, to the device in one copy
        both = to_device(numpy.stack([order, numpy.argsort(order, kind="stable")]))
        outs, at = [], 0
        for i in range(self.per_rank):
            m = int(got[:, i].sum())
            if m:
                outs.append(self.local_expert(received[both[0, at:at + m]], self.lo + i))   # (m, C)
            at += m
        out = outs[0] if len(outs) == 1 else ops.concat(outs, axis=0)   # expert by expert
        return out[both[1]]                                             # back in received order


def _square_sum(params):
    """The sum of the gradients' squares, a float: each tensor's sum where it lives, added in
    float64 in parameter order (a cumsum, as a Python sum adds them); one number comes home."""
    if not params:
        return 0.0
    parts = xp.stack([(p.grad ** 2).sum() for p in params]).astype(xp.float64)
    return float(xp.cumsum(parts)[-1])


def _slice(stacked, lo, hi):
    """A StackedLinear holding experts [lo, hi) of `stacked` (copies)."""
    part = StackedLinear.__new__(StackedLinear)
    part.weight = Parameter(xp.array(stacked.weight.data[lo:hi]))
    part.bias = None if stacked.bias is None else Parameter(xp.array(stacked.bias.data[lo:hi]))
    return part

# ----------------------------------------------------------------------------- the model and its gradients


def expert_parallel(model, ep_comm, dp_comm=None, pad_to_capacity=False):
    """Swap every MoEMLP of `model` for an ExpertParallelMoE (in place); return the
    ExpertParallel that synchronises the gradients (train_step's dp slot).

    ep_comm: the ranks one layer's experts are spread over; dp_comm: every data-parallel
    rank (the dense weights' all-reduce), ep_comm when None. Build the optimizer after
    this call: the expert Parameters are new ones. pad_to_capacity: ExpertParallelMoE's.

    `model` may be a GPT or a TensorParallelGPT (its MoE blocks keep their MLP whole):
    the MoEMLPs are swapped wherever they sit, and ep_comm, dp_comm are then this TP
    rank's groups (the grid's dp_comm for both when ep = dp); hand the result to
    TensorParallelSync(model, dp=...) as train_step's dp slot.
    """
    dp_comm = ep_comm if dp_comm is None else dp_comm
    if dp_comm.Get_size() % ep_comm.Get_size():
        raise ValueError(f"the ep group ({ep_comm.Get_size()} ranks) is carved out of the data-parallel "
                         f"ranks ({dp_comm.Get_size()}): their number must be a multiple of it")
    for block in model.transformer.h:
        if isinstance(block.mlp, MoEMLP) and not isinstance(block.mlp, ExpertParallelMoE):
            block.mlp = ExpertParallelMoE(block.mlp, ep_comm, pad_to_capacity)
    return ExpertParallel(model, ep_comm, dp_comm)


class ExpertParallel(Strategy):
    """The gradient synchroniser of an expert-parallel model, and its per-step counters."""

    def __init__(self, model, ep_comm, dp_comm):
        self.model, self.ep_comm, self.dp_comm = model, ep_comm, dp_comm
        self.layers = [(i, b.mlp) for i, b in enumerate(model.transformer.h)
                       if isinstance(b.mlp, ExpertParallelMoE)]
        ids = {id(p) for _, m in self.layers for p in (*m.c_fc.parameters(), *m.c_proj.parameters())}
        self.expert_params = [p for p in model.parameters() if id(p) in ids]
        self.dense_params = [p for p in model.parameters() if id(p) not in ids]
        # the ranks holding the same experts as this one: same ep rank, other dp_outer index
        self.expert_dp_comm = (dp_comm.Split(color=ep_comm.Get_rank(), key=dp_comm.Get_rank())
                               if dp_comm.Get_size() > ep_comm.Get_size() else None)
        self.history = []             # per step: {layer: (tokens per expert, dropped)}, this rank's


    def __call__(self, *args, **kw):
        return self.model(*args, **kw)

    # backward_context: Strategy's (nothing): the all-to-alls run inside backward; sync()
    # does the rest

    def sync(self):
        """Dense gradients: the mean over every data-parallel rank. Expert gradients: the sum
        over the copies of the same experts, divided by the number of data-parallel ranks."""
        self.history.append({i: (numpy.array(m.aux["tokens_per_expert"]), m.aux["dropped"])
                             for i, m in self.layers if m.aux is not None})
        grads = [p.grad if p.grad is not None else xp.zeros_like(p.data) for p in self.dense_params]
        for p, g in zip(self.dense_params, average_gradients(self.dp_comm, grads)):
            p.grad = g
        n = self.dp_comm.Get_size()
        for p in self.expert_params:
            g = p.grad if p.grad is not None else xp.zeros_like(p.data)
            if self.expert_dp_comm is not None:
                g = all_reduce(self.expert_dp_comm, g, op="sum")
            p.grad = g / n

    def grad_norm_sq(self, params):
        """The whole model's squared gradient norm (for clipping): the dense part is the same
        on every rank; the experts' parts are summed over the ep group."""
        experts = {id(p) for p in self.expert_params}
        dense = _square_sum([p for p in params if p.grad is not None and id(p) not in experts])
        return dense + self.expert_grad_norm_sq(params)

    def expert_grad_norm_sq(self, params):
        """The experts' part of the squared norm: the experts among `params` this rank holds,
        summed over the ep group (which holds each expert once). Under tensor parallelism,
        TensorParallelSync.grad_norm_sq adds it to the shards' and the replicated part."""
        experts = {id(p) for p in self.expert_params}
        mine = _square_sum([p for p in params if p.grad is not None and id(p) in experts])
        total = all_reduce(self.ep_comm, numpy.array([mine]), op="sum")
        return float(total[0])

    # -- counters
    def reset_counters(self):
        for _, m in self.layers:
            m.comm_bytes = []

    def counters(self):
        """What the last forward's routers did, per MoE layer: this rank's and the whole
        ep group's tokens per expert (after capacity), dropped choices, the balance and z
        losses (this rank's group), all-to-all bytes sent since reset_counters(): measured
        and by the formula (4 all-to-alls per layer per step)."""
        out = {}
        for i, m in self.layers:
            a = m.aux
            local = numpy.asarray(a["tokens_per_expert"], numpy.int64)
            dropped = numpy.array([a["dropped"]], numpy.int64)
            out[i] = dict(tokens_per_expert=local,
                          tokens_per_expert_total=self._sum(local), dropped=a["dropped"],
                          dropped_total=int(self._sum(dropped)[0]),
                          balance=a["balance"].item(), z=a["z"].item(),
                          a2a_bytes_measured=sum(b for _, b, _ in m.comm_bytes),
                          a2a_bytes_formula=sum(f for _, _, f in m.comm_bytes),
                          a2a_calls=len(m.comm_bytes))
        return out

    def _sum(self, a):
        """Sum over the ep group with MPI's own Allreduce: a report, not part of training."""
        from mpi4py import MPI
        total = numpy.empty_like(a)
        self.ep_comm.Allreduce(a, total, op=MPI.SUM)
        return total
