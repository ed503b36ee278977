"""Which pieces of which global tensors a rank holds, under each strategy; and how a rank
fills its model and optimizer from a checkpoint saved under any layout.

A checkpoint stores GLOBAL tensors, named as the single-process run names them:

    model.<param>               the weights, as model.named_parameters() calls them
    optim.exp_avg.<param>       AdamW's m, the shape of the parameter
    optim.exp_avg_sq.<param>    AdamW's v
    optim.step                  AdamW's step count (int64, one for all parameters)
    optim.v_step                only once AdamW's variance is frozen (1-bit Adam, 1-bit
                                gradients after their warm-up): the step v was frozen at,
                                its bias correction's t (int64); loading it freezes v again

Each rank writes the pieces it is responsible for, each piece a part of one global tensor:
a box (one [start, stop) per dimension: a tensor-parallel shard) or a flat range of the
tensor read in C order (a ZeRO partition). What a rank writes under each layout:

    one process, data parallelism   whole tensors, dealt round robin over the ranks (the
                                    replicas are equal: each tensor is written once, and
                                    the bytes are spread over the ranks)
    ZeRO 1, 2, 3 and FSDP           its partition: a flat range of each parameter it
                                    overlaps, for the weights and for m and v alike

    tensor parallelism              its shard: one box per block of the cut axis (c_attn's
                                    q | k | v are three), the vocabulary's padding left out
    a pipeline stage, TP x PP       the parameters of its layers (the tied wte, held by the
                                    first and the last stage, written once), as above
    expert parallelism              experts [lo, hi) of E: a box of the stacked tensors

Each strategy reports what it holds (Strategy.checkpoint_pieces and the other checkpoint_*
hooks of minidist/parallel/strategy.py): ZeRO and FSDP their partitions; the default reads
the model (minidist/parallel/pieces.py: Held, tp_regions), whose parts say how they are
cut (TensorParallelGPT.tensor_parallel, a pipeline stage's tensor_parallel and
pipeline_stages, ExpertParallelMoE.held_experts); the optimizers say where their AdamW
state is (optim.Optimizer.adamw, .checkpoint_params, .checkpoint_loaded: MixedPrecision's
fp32 masters). This file does not reach into a strategy's or an optimizer's internals.

Loading is the same for every layout: a rank asks the checkpoint for exactly the regions
its new layout holds (a box, or a flat range), whatever layout wrote them; the store
assembles each region from the pieces that overlap it. So a checkpoint saved by ZeRO-3
on 4 ranks loads into one process, data parallelism on 3, FSDP on 3 or TP 2 x PP 2.
(Not mapped: ZeRO-1 inside 3D, whose partitions are flat ranges of TP shards.)
"""
import numpy as np

from minidist.backend import to_device, to_numpy, xp
from minidist.checkpoint import store
from minidist.checkpoint.format import CheckpointError
from minidist.checkpoint.index import check_against, load_index, resolve
from minidist.checkpoint.read import read_global, read_region
from minidist.parallel.pieces import (  # noqa: F401  (Held, tp_regions: exercise 11.1)
    Held, _states_of, _tensor_parallel_of, expert_slices, tp_regions)
from minidist.parallel.strategy import Strategy

STEP = "optim.step"
V_STEP = "optim.v_step"


def held_pieces(model, opt, zero=None):
    """Every region of every global tensor this rank holds (replicas included), and the
    AdamW states it read them from: what the strategy reports (Strategy.checkpoint_pieces).

    model: a GPT, a TensorParallelGPT, a PipelineGPT (over either), whatever holds the
    parameters under the single-process names; opt: its AdamW; zero: a ZeRO (stages
    1-3, FSDP) over `model`, whose partitions are then the pieces."""
    return _strategy(zero).checkpoint_pieces(model, opt)


def _strategy(zero):
    """The strategy whose pieces a checkpoint holds: ZeRO's partitions, or the model's own."""
    return zero if zero is not None else Strategy()


def _step_of(states):
    """The one AdamW step count of these states (0 before the first step); refuse a run whose
    parameters stepped different numbers of times (a checkpoint keeps one count)."""
    steps = {int(s["step"]) for s in states if s is not None}
    if len(steps) > 1:
        raise ValueError(f"the parameters' AdamW step counts differ ({sorted(steps)}): a checkpoint keeps one")
    return steps.pop() if steps else 0


def writers(comm, held):
    """Which of my held regions I write: every distinct region of every tensor is written
    by exactly one of the ranks that hold it (data-parallel replicas, the tied embedding's
    two stages, a tensor replicated over the tensor-parallel group), chosen round robin by
    the region's position in the sorted list of all, so the bytes spread over the ranks.

    The ranks learn each other's regions from one all-gather of their JSON (MPI's own:
    bookkeeping, not a checkpoint's bytes)."""
    import json
    mine = json.dumps([h.key() for h in held]).encode()
    everyone = _allgather_bytes(comm, mine)
    holders = {}
    for r, text in enumerate(everyone):
        for k in json.loads(text):
            holders.setdefault(json.dumps(k), []).append(r)
    order = {k: i for i, k in enumerate(sorted(holders))}
    rank = comm.Get_rank()
    out = []
    for h in held:
        k = json.dumps(h.key())
        ranks = holders[k]
        if ranks[order[k] % len(ranks)] == rank:
            out.append(h)
    return out


def _allgather_bytes(comm, data):
    """Every rank's bytes, in rank order (two Allgathers: the lengths, then Allgatherv)."""
    size = comm.Get_size()
    n = np.array([len(data)], np.int64)
    lengths = np.empty(size, np.int64)
    comm.Allgather(n, lengths)
    out = np.empty(int(lengths.sum()), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    comm.Allgatherv(np.frombuffer(data, np.uint8), [out, lengths, offsets, _byte()])
    return [out[o:o + k].tobytes().decode() for o, k in zip(offsets, lengths)]


def _byte():
    from mpi4py import MPI
    return MPI.BYTE


def pieces_of(model, opt, comm, zero=None):
    """The pieces this rank writes (store.save's form), and the optimizer's step count."""
    held, states = held_pieces(model, opt, zero)
    step = _agreed_step(comm, _step_of(states))
    # the one place a save crosses from device to host: each piece I write, brought home
    # explicitly (to_numpy: counted on a device; on the CPU the array itself)
    out = [{"name": h.name, "global_shape": h.shape, "dtype": h.local.dtype,
            "array": np.asarray(to_numpy(h.local), order="C"), **h.region} for h in writers(comm, held)]
    frozen = _agreed_step(comm, _v_step_of(_strategy(zero).checkpoint_optimizer(opt), states))
    if comm.Get_rank() == 0:     # (np.asarray keeps a 0-d array 0-d; ascontiguousarray would not)
        out.append({"name": STEP, "global_shape": (), "dtype": np.dtype(np.int64),
                    "array": np.array(step, np.int64), "box": []})
        if frozen:
            out.append({"name": V_STEP, "global_shape": (), "dtype": np.dtype(np.int64),
                        "array": np.array(frozen, np.int64), "box": []})
    return out, step


def _adamw_of(opt):
    """The AdamW inside a wrapper (MixedPrecision, OneBitAdam: Optimizer.adamw), or None
    (no optimizer, or another kind)."""
    return opt.adamw() if opt is not None else None


def _v_step_of(opt, states):
    """The step AdamW's variance was frozen at (0: not frozen, or no state yet); the
    parameters' v_step must agree, as their step counts do."""
    adamw = _adamw_of(opt)
    if adamw is None or not adamw.variance_frozen:
        return 0
    v_steps = {int(s["v_step"]) for s in states if s is not None and "v_step" in s}
    if len(v_steps) > 1:
        raise ValueError(f"the parameters' frozen-variance steps differ ({sorted(v_steps)}): "
                         "a checkpoint keeps one")
    return v_steps.pop() if v_steps else 0


def _agreed_step(comm, step):
    """Every rank's step count is the same (a rank that holds no state says 0 only before
    the first step): the largest."""
    mine = np.array([step], np.int64)
    top = np.empty_like(mine)
    comm.Allreduce(mine, top, op=_op("MAX"))
    return int(top[0])


def _op(name):
    from mpi4py import MPI
    return getattr(MPI, name)


def expected_tensors(model, zero=None, with_optimizer=True):
    """{global name: (shape, dtype)} of the tensors this rank holds part of: what the
    checkpoint must hold for it, at these shapes."""
    named = _strategy(zero).checkpoint_tensors(model)
    out = {f"model.{n}": (s, np.dtype(d)) for n, s, d in named}
    if with_optimizer:
        for n, s, d in named:
            out[f"optim.exp_avg.{n}"] = (s, np.dtype(d))
            out[f"optim.exp_avg_sq.{n}"] = (s, np.dtype(d))
        out[STEP] = ((), np.dtype(np.int64))
    return out


def load_into(ckpt, index, model, opt, zero=None, read=None):
    """Fill this rank's weights and AdamW state from the checkpoint, reading only the
    regions this rank's layout holds. Returns the optimizer's step count.

    read(name, region): the store's reader of one region ({"box": ...} or {"flat": ...})."""
    step = int(read(STEP, {"box": []})) if STEP in index["tensors"] else 0
    v_step = int(read(V_STEP, {"box": []})) if V_STEP in index["tensors"] else 0
    strategy = _strategy(zero)
    target = strategy.checkpoint_optimizer(opt)
    # AdamW's state appears when the first step runs; a resumed run needs it now
    params = strategy.checkpoint_params(model, opt)
    if step and target is not None:
        states = _states_of(target)
        for q in params:
            # v_step: v's bias-correction step, which is the step itself until v is frozen
            states[id(q)] = {"step": step, "exp_avg": xp.zeros_like(q.data), "exp_avg_sq": xp.zeros_like(q.data),
                             "v_step": v_step or step}
        adamw = _adamw_of(target)
        if adamw is not None:
            adamw.variance_frozen = bool(v_step)
    held, _ = strategy.checkpoint_pieces(model, opt)
    for h in held:
        if h.name.startswith("optim.") and not step:
            continue
        # the one place a load crosses from host to device: the region read from the files
        # (to_device: counted on a device; on the CPU the array itself)
        h.local[...] = to_device(read(h.name, h.region).reshape(h.local.shape))
    strategy.checkpoint_loaded()                # ZeRO 1, 2: the whole weights on every rank
    if zero is None and opt is not None:   # MixedPrecision: the masters rounded into the weights
        opt.checkpoint_loaded()
    return step


# ----------------------------------------------------------------------------- save and load a run

def layout_of(comm, zero=None, model=None):
    """The layout's description, kept in the index (`show` prints it)."""
    n = comm.Get_size()
    kind = _strategy(zero).checkpoint_layout(model)
    if kind:
        return {"kind": kind, "ranks": n}
    tp = _tensor_parallel_of(model) if model is not None else None
    pp = getattr(model, "pipeline_stages", None)       # a PipelineGPT says how many stages
    parts = ([f"tp{tp.tp}"] if tp is not None else []) + ([f"pp{pp}"] if pp else [])
    if model is not None and expert_slices(model):
        parts.append("ep")
    kind = " x ".join(parts) or ("data_parallel" if n > 1 else "single")
    return {"kind": kind, "ranks": n}


def state_pieces(comm, state):
    """The run's other state as pieces: state["shared"] {name: array} (the same on every rank:
    a loss scale, a curriculum's position) written by rank 0 as `run.<name>`; state["per_rank"]
    {name: array} (error-feedback residuals, which differ by rank) stacked along a first axis
    of the ranks as `rank.<name>`, rank r writing row r."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = []
    for name, a in sorted((state or {}).get("shared", {}).items()):
        a = to_numpy(a)              # a device array (a residual, a scale) comes home once
        if rank == 0:
            out.append({"name": f"run.{name}", "global_shape": a.shape, "dtype": a.dtype, "array": a,
                        "box": [[0, n] for n in a.shape]})
    for name, a in sorted((state or {}).get("per_rank", {}).items()):
        a = to_numpy(a)
        out.append({"name": f"rank.{name}", "global_shape": (size,) + a.shape, "dtype": a.dtype,
                    "array": a[None], "box": [[rank, rank + 1]] + [[0, n] for n in a.shape]})
    return out


def read_state(comm, path):
    """The run's other state saved with `state=`: ({name: shared array}, {name: this rank's row}),
    host arrays (the caller sends what lives on the device there: backend.to_device).

    Per-rank state belongs to ranks: it loads only at the world size that saved it (the
    residuals of 4 ranks mean nothing to 3); at another size it is left out, and said so."""

    def work():
        ckpt = resolve(path)
        index = load_index(ckpt)
        shared, mine, dropped = {}, {}, []
        for name, t in index["tensors"].items():
            if name.startswith("run."):
                shared[name[4:]] = read_global(ckpt, index, name)
            elif name.startswith("rank."):
                if t["shape"][0] != comm.Get_size():
                    dropped.append(name[5:])
                    continue
                box = [[comm.Get_rank(), comm.Get_rank() + 1]] + [[0, n] for n in t["shape"][1:]]
                mine[name[5:]] = read_region(ckpt, index, name, box=box)[0]
        return shared, mine, dropped
    return agreed(comm, work)


def save(comm, root, train_step, model, opt, zero=None, meta=None, keep=None, state=None):
    """Write this run's state as checkpoint `train_step` under `root` (every rank calls it).

    train_step: the steps trained so far: the data position and the learning-rate
    schedule's position (batches, the schedule and dropout masks are functions of it).
    state: the run's other state, {"shared": {...}, "per_rank": {...}} (state_pieces)."""
    import dataclasses
    import json
    pieces, opt_step = pieces_of(model, opt, comm, zero)
    pieces += state_pieces(comm, state)
    # every tensor some rank's model has must be in the checkpoint (one all-gather of names)
    mine = sorted(expected_tensors(model, zero, with_optimizer=opt_step > 0))
    require = set().union(*(json.loads(t) for t in _allgather_bytes(comm, json.dumps(mine).encode())))
    meta = dict(meta or {}, train_step=int(train_step), optimizer_step=opt_step, layout=layout_of(comm, zero, model))
    if dataclasses.is_dataclass(getattr(model, "config", None)):      # the shape export writes out
        meta.setdefault("model", dataclasses.asdict(model.config))
    return store.save(comm, root, int(train_step), pieces, meta, keep=keep, require=require)


def load(comm, path, model, opt, zero=None):
    """Fill this rank's model and optimizer from the checkpoint at `path` (a checkpoint, or a
    folder of them: its latest), whatever layout saved it. Returns the index's meta.

    A problem found on any rank (a file that fails its checksum, a tensor of another shape)
    is raised on every rank, with the words of the lowest rank that found one."""
    import json
    expected = expected_tensors(model, zero)
    # what the ranks hold together (a pipeline stage holds some layers only): one all-gather
    union = set().union(*(json.loads(t) for t in _allgather_bytes(comm, json.dumps(sorted(expected)).encode())))

    def work():
        ckpt = resolve(path)
        index = load_index(ckpt)
        names = index["tensors"]
        if any(n.startswith("model.") for n in names) and not any(n.startswith("optim.") for n in names):
            raise CheckpointError(f"{ckpt}: weights only (no AdamW m, v, step): resume from what "
                                  "a training run saved")
        check_against(index, expected, extra_ok=True)
        extra = sorted(n for n in set(index["tensors"]) - union - {V_STEP}
                       if not n.startswith(("run.", "rank.")))
        if extra:
            raise CheckpointError(f"the checkpoint holds {extra[0]!r}, which no rank's model has (another model?)")

        def read(name, region):
            return read_region(ckpt, index, name, **region)
        load_into(ckpt, index, model, opt, zero, read)
        return index["meta"]
    return agreed(comm, work)


def agreed(comm, fn):
    """fn() on every rank; a CheckpointError on any rank becomes the same error on all
    (store.agree: the lowest failing rank's words, broadcast)."""
    error, result = None, None
    try:
        result = fn()
    except CheckpointError as e:
        error = str(e)
    store.agree(comm, error)
    return result

