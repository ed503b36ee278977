"""Which pieces of which global tensors a rank's model holds: whole tensors, tensor-parallel
shards, a pipeline stage's layers, expert-parallel experts (Strategy.checkpoint_pieces and
the other checkpoint_* hooks of minidist/parallel/strategy.py read the model through here;
ZeRO and FSDP report their partitions as Held too, minidist/parallel/zero.py).

A leaf module: NumPy and minidist.plan.rules only, so that the strategies import it without
importing minidist.checkpoint (which sits above them and calls the hooks) or MPI. Each piece
is a region of one global tensor, named as the single-process run names it: a box (one
[start, stop) per dimension) or a flat range of the tensor read in C order.
"""
from minidist.plan.rules import chunk_bounds


class Held:
    """One region of one global tensor that this rank holds: `local` is the array (a view
    into the rank's parameter or optimizer state) whose values are that region."""
    __slots__ = ("name", "shape", "region", "local")

    def __init__(self, name, shape, region, local):
        self.name, self.shape, self.region, self.local = name, tuple(shape), region, local

    def key(self):
        return [self.name, sorted(self.region.items())]


def tp_regions(full_shape, spec, rank, t):
    """[(box of the global tensor, index into the local shard)] of tensor-parallel rank
    `rank` of t, for a parameter cut as `spec` says (minidist/parallel/tp_model.py's Shard;
    None: replicated, one box of the whole). The cut axis holds `spec.blocks` equal blocks
    (c_attn's q | k | v are three), each cut in t by numpy.array_split's rule, so a rank's
    shard is one box per block; rows of the vocabulary's zero padding belong to no global
    tensor and are left out. (Exercise 11.1.)"""
    if spec is None:
        return [([[0, n] for n in full_shape], tuple(slice(None) for _ in full_shape))]
    axis = spec.axis
    padded = spec.padded or full_shape[axis]
    block = padded // spec.blocks
    lb = chunk_bounds(block, t)
    mine = lb[rank + 1] - lb[rank]
    out = []
    for b in range(spec.blocks):
        g0 = b * block + lb[rank]
        g1 = min(g0 + mine, spec.size if spec.size is not None else full_shape[axis])
        if g1 <= g0:
            continue                                # all padding
        box = [[0, n] for n in full_shape]
        box[axis] = [g0, g1]
        index = [slice(None)] * len(full_shape)
        index[axis] = slice(b * mine, b * mine + (g1 - g0))
        out.append((box, tuple(index)))
    return out


def model_pieces(model, opt):
    """The pieces of a model that holds whole tensors, tensor-parallel shards (tp_regions),
    a pipeline stage's layers or expert-parallel experts (Strategy.checkpoint_pieces)."""
    out, states = [], []
    tp = _tensor_parallel_of(model)
    experts = expert_slices(model)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    held = opt.checkpoint_params(params) if opt is not None else params   # MixedPrecision: masters
    for (name, _), p in zip(named, held):
        full_shape = tp.full_shapes[name] if tp is not None else tuple(p.shape)
        spec = tp.specs.get(name) if tp is not None else None
        if name in experts:                      # experts [lo, hi) of E: one box along the first axis
            lo, hi, E = experts[name]
            full_shape = (E,) + tuple(p.shape[1:])
            s = _states_of(opt).get(id(p)) if opt is not None else None
            states.append(s)
            box = {"box": [[lo, hi]] + [[0, n] for n in p.shape[1:]]}
            out.append(Held(f"model.{name}", full_shape, box, p.data))
            if s is not None:
                out.append(Held(f"optim.exp_avg.{name}", full_shape, box, s["exp_avg"]))
                out.append(Held(f"optim.exp_avg_sq.{name}", full_shape, box, s["exp_avg_sq"]))
            continue
        s = _states_of(opt).get(id(p)) if opt is not None else None
        states.append(s)
        rank, t = (tp.tp_rank, tp.tp) if tp is not None else (0, 1)
        regions = tp_regions(full_shape, spec, rank, t)      # a module global: exercise 11.1's plug-in
        for box, index in regions:
            region = {"box": box}
            out.append(Held(f"model.{name}", full_shape, region, p.data[index]))
            if s is not None:
                out.append(Held(f"optim.exp_avg.{name}", full_shape, region, s["exp_avg"][index]))
                out.append(Held(f"optim.exp_avg_sq.{name}", full_shape, region, s["exp_avg_sq"][index]))
    return out, states


def model_tensors(model):
    """[(name, global shape, dtype)] of a model's parameters (Strategy.checkpoint_tensors)."""
    tp, experts = _tensor_parallel_of(model), expert_slices(model)
    return [(n, (experts[n][2],) + tuple(p.shape[1:]) if n in experts else
             tp.full_shapes[n] if tp is not None else tuple(p.shape), p.dtype)
            for n, p in model.named_parameters()]


def model_params(model, opt):
    """The tensors `opt` keeps AdamW state for: the model's parameters, or their fp32
    masters under mixed precision (Strategy.checkpoint_params)."""
    params = list(model.parameters())
    return opt.checkpoint_params(params) if opt is not None else params


def expert_slices(model):
    """{parameter name: (lo, hi, E)} of the expert weights an expert-parallel layer holds
    (minidist/parallel/expert_parallel.py: experts [lo, hi) of E, stacked on the first axis)."""
    out = {}
    for prefix, m in model.named_modules() if hasattr(model, "named_modules") else []:
        held = getattr(m, "held_experts", None)       # an ExpertParallelMoE says which it holds
        if held is not None:
            for sub in ("c_fc", "c_proj"):
                for n, _ in getattr(m, sub).named_parameters():
                    out[f"{prefix}{sub}.{n}"] = held()     # (prefix ends with a dot)
    return out


def _states_of(opt):
    """AdamW's state dict: the optimizer's own, or the one inside a wrapper (MixedPrecision,
    OneBitAdam: Optimizer.adamw)."""
    adamw = opt.adamw()
    return adamw.state if adamw is not None else opt.state


def _tensor_parallel_of(model):
    """The TensorParallelGPT a model is (or a pipeline stage was cut from), else None:
    each says so (TensorParallelGPT.tensor_parallel, PipelineGPT.tensor_parallel)."""
    return getattr(model, "tensor_parallel", None)
