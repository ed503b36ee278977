"""Which pieces of which global tensors a rank holds, under each strategy; and how a rank
fills its model and optimizer from a checkpoint saved under any layout.

A checkpoint stores GLOBAL tensors, named as the single-process run names them:

    model.<param>               the weights, as model.named_parameters() calls them
    optim.exp_avg.<param>       AdamW's m, the shape of the parameter
    optim.exp_avg_sq.<param>    AdamW's v
    optim.step                  AdamW's step count (int64, one for all parameters)

Each rank writes the pieces it is responsible for, each piece a part of one global tensor:
a box (one [start, stop) per dimension: a tensor-parallel shard) or a flat range of the
tensor read in C order (a ZeRO partition). What a rank writes under each layout:

    one process, data parallelism   whole tensors, dealt round robin over the ranks (the
                                    replicas are equal: each tensor is written once, and
                                    the bytes are spread over the ranks)
    ZeRO 1, 2, 3 and FSDP           its partition: a flat range of each parameter it
                                    overlaps, for the weights and for m and v alike

Loading is the same for every layout: a rank asks the checkpoint for exactly the regions
its new layout holds (a whole tensor, or a flat range), whatever layout wrote them; the
store assembles each region from the pieces that overlap it. So a checkpoint saved by
ZeRO-3 on 4 ranks loads into one process, into data parallelism on 3, or into FSDP on 3.
(Tensor and pipeline parallelism are not mapped yet: see the issue's note.)
"""
import numpy as np

STEP = "optim.step"


def _flat_spans(group):
    """(piece, owner parameter, name, a, b) for each piece of a flat_shards.Group: the
    piece holds elements [a, b) of its parameter, flattened in C order."""
    out = []
    for q, p, label in zip(group.pieces, group.owner, group.names_of_pieces):
        name, span = label.rsplit("[", 1)
        a, b = (int(v) for v in span.rstrip("]").split(":"))
        out.append((q, p, name, a, b))
    return out


def _adam_state(opt, tensor):
    return opt.state.get(id(tensor))


def _step_of(states):
    """The one AdamW step count of these states (0 before the first step); refuse a run whose
    parameters stepped different numbers of times (a checkpoint keeps one count)."""
    steps = {int(s["step"]) for s in states if s is not None}
    if len(steps) > 1:
        raise ValueError(f"the parameters' AdamW step counts differ ({sorted(steps)}): a checkpoint keeps one")
    return steps.pop() if steps else 0


def _piece(name, shape, array, **where):
    return {"name": name, "global_shape": tuple(shape), "dtype": np.asarray(array).dtype,
            "array": np.asarray(array, order="C"), **where}   # (ascontiguousarray would make 0-d 1-d)


def pieces_of(model, opt, comm, zero=None):
    """The pieces this rank writes, and the step count of the optimizer.

    model, opt: the GPT and its AdamW (for ZeRO and FSDP, `zero` is the ZeRO object, which
    holds the optimizer of this rank's partition in zero.inner)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    named = model.named_parameters()
    shapes = {n: tuple(p.shape) for n, p in named} if zero is None else {
        n: tuple(s) for g in zero.groups for n, s in zip(g.names, g.shapes)}
    out = []
    if zero is None:
        states = [_adam_state(opt, p) for _, p in named]
        for i, (name, p) in enumerate(named):
            if i % size != rank:                       # round robin: each tensor written once
                continue
            box = {"box": [[0, n] for n in p.shape]}
            out.append(_piece(f"model.{name}", p.shape, p.data, **box))
            s = _adam_state(opt, p)
            if s is not None:
                out.append(_piece(f"optim.exp_avg.{name}", p.shape, s["exp_avg"], **box))
                out.append(_piece(f"optim.exp_avg_sq.{name}", p.shape, s["exp_avg_sq"], **box))
    else:
        states = []
        for g in zero.groups:
            for q, _, name, a, b in _flat_spans(g):
                flat = {"flat": [a, b]}
                out.append(_piece(f"model.{name}", shapes[name], q.data.reshape(-1), **flat))
                s = _adam_state(zero.inner, q)
                states.append(s)
                if s is not None:
                    out.append(_piece(f"optim.exp_avg.{name}", shapes[name], s["exp_avg"].reshape(-1), **flat))
                    out.append(_piece(f"optim.exp_avg_sq.{name}", shapes[name], s["exp_avg_sq"].reshape(-1),
                                      **flat))
    step = _agreed_step(comm, _step_of(states))
    if rank == 0:
        out.append(_piece(STEP, (), np.array(step, dtype=np.int64), box=[]))
    return out, step


def _agreed_step(comm, step):
    """Every rank's step count is the same (a rank that holds no state says 0 only before
    the first step): the largest, checked against each rank's."""
    mine = np.array([step], np.int64)
    top = np.empty_like(mine)
    comm.Allreduce(mine, top, op=_max())
    return int(top[0])


def _max():
    from mpi4py import MPI
    return MPI.MAX


def expected_tensors(model, zero=None, with_optimizer=True):
    """{global name: (shape, dtype)} that a checkpoint of this model must hold."""
    if zero is None:
        named = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    else:
        named = [(n, tuple(s), g.dtype) for g in zero.groups for n, s in zip(g.names, g.shapes)]
    out = {f"model.{n}": (s, np.dtype(d)) for n, s, d in named}
    if with_optimizer:
        for n, s, d in named:
            out[f"optim.exp_avg.{n}"] = (s, np.dtype(d))
            out[f"optim.exp_avg_sq.{n}"] = (s, np.dtype(d))
        out[STEP] = ((), np.dtype(np.int64))
    return out


def _new_state(step, m, v):
    return {"step": step, "exp_avg": m, "exp_avg_sq": v}


def load_into(ckpt, index, model, opt, zero=None, read=None):
    """Fill this rank's weights and AdamW state from the checkpoint, reading only the
    regions this rank's layout holds. Returns the optimizer's step count.

    read(name, flat=None): the store's reader of a global tensor (whole) or a flat range."""
    step = int(read(STEP)) if STEP in index["tensors"] else 0
    if zero is None:
        for name, p in model.named_parameters():
            p.data[...] = read(f"model.{name}").astype(p.dtype, copy=False)
            if step and opt is not None:
                opt.state[id(p)] = _new_state(step, read(f"optim.exp_avg.{name}").astype(p.dtype),
                                              read(f"optim.exp_avg_sq.{name}").astype(p.dtype))
        return step
    for g in zero.groups:
        for q, _, name, a, b in _flat_spans(g):
            q.data[...] = read(f"model.{name}", flat=(a, b)).reshape(q.shape)
            if step:
                zero.inner.state[id(q)] = _new_state(
                    step, read(f"optim.exp_avg.{name}", flat=(a, b)).reshape(q.shape).astype(q.dtype),
                    read(f"optim.exp_avg_sq.{name}", flat=(a, b)).reshape(q.shape).astype(q.dtype))
        if zero.stage < 3:                         # the whole weights on every rank, as after a step
            from minidist.comm import ring_all_gather
            g.write_back(ring_all_gather(zero.comm, g.flat_data()[g.lo:g.hi]))
    return step


# ----------------------------------------------------------------------------- save and load a run

def layout_of(comm, zero=None):
    """The layout's description, kept in the index (`show` prints it)."""
    if zero is None:
        return {"kind": "data_parallel" if comm.Get_size() > 1 else "single", "ranks": comm.Get_size()}
    return {"kind": f"zero{zero.stage}", "ranks": comm.Get_size()}


def save(comm, root, train_step, model, opt, zero=None, meta=None, keep=None):
    """Write this run's state as checkpoint `train_step` under `root` (every rank calls it).

    train_step: the steps trained so far: the data position and the learning-rate
    schedule's position (batches, the schedule and dropout masks are functions of it)."""
    from minidist.checkpoint import store
    pieces, opt_step = pieces_of(model, opt, comm, zero)
    meta = dict(meta or {}, train_step=int(train_step), optimizer_step=opt_step, layout=layout_of(comm, zero))
    return store.save(comm, root, int(train_step), pieces, meta, keep=keep)


def load(comm, path, model, opt, zero=None):
    """Fill this rank's model and optimizer from the checkpoint at `path` (a checkpoint, or a
    folder of them: its latest), whatever layout saved it. Returns the index's meta.

    A problem found on any rank (a file that fails its checksum, a tensor of another shape)
    is raised on every rank, with the words of the lowest rank that found one."""
    from minidist.checkpoint import store

    def work():
        ckpt = store.resolve(path)
        index = store.load_index(ckpt)
        store.check_against(index, expected_tensors(model, zero))

        def read(name, flat=None):
            if flat is None:
                return store.read_global(ckpt, index, name)
            return store.read_region(ckpt, index, name, flat=flat)
        load_into(ckpt, index, model, opt, zero, read)
        return index["meta"]
    return agreed(comm, work)


def agreed(comm, fn):
    """fn() on every rank; a CheckpointError on any rank becomes the same error on all."""
    from minidist.checkpoint.format import CheckpointError
    error, result = None, None
    try:
        result = fn()
    except CheckpointError as e:
        error = str(e)
    rank, size = comm.Get_rank(), comm.Get_size()
    first = np.array([rank if error is not None else size], np.int64)
    low = np.empty_like(first)
    comm.Allreduce(first, low, op=_min())
    who = int(low[0])
    if who == size:
        return result
    text = np.frombuffer((error or "").encode(), np.uint8) if rank == who else None
    n = np.array([0 if text is None else len(text)], np.int64)
    comm.Bcast(n, root=who)
    buf = text.copy() if rank == who else np.empty(int(n[0]), np.uint8)
    comm.Bcast(buf, root=who)
    message = buf.tobytes().decode()
    raise CheckpointError(message if rank == who else f"{message} (found on rank {who})")


def _min():
    from mpi4py import MPI
    return MPI.MIN
