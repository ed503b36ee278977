"""Checks for lessons/exercises/11_checkpoints.py: the boxes a tensor-parallel rank holds,
and one saved piece copied into a region of another layout.

Each function is compared with a referee written here again, as plainly as the rule
reads, on many inputs, and only after the student's function has returned; the inputs
must come back unchanged. Then the check plugs the function into the package and saves
and loads real checkpoints with it, against the same round trip with the package's own
answer:

- 11.1 tp_regions(full_shape, spec, rank, t): every parameter of a tiny GPT (with biases
  and without) under shard_specs(config, t) for t = 1 .. 5, vocabularies that need
  padding at some t and not at others, c_attn's three blocks (q | k | v) with columns
  that do not divide by t, the replicated tensors (spec None, 1-D and 2-D), and cuts
  made up here (a padded axis where a rank's chunk is all padding, blocks shorter than
  t). Besides the referee's answer, a property that needs no referee: with the local
  shard built by minidist.parallel.tp_model.shard from a random global array,
  shard[index] == global[box] for every (box, index), every box lies inside the global
  shape and is not empty, the boxes of all t ranks cover every element of the global
  tensor exactly once (a replicated tensor: each rank's boxes do), and the indexes are
  plain slices (views: loading writes through them). Boxes hold Python ints (the
  checkpoint's index is JSON).
- 11.2 copy_overlap(out, out_box, piece, piece_box): random boxes in 1, 2 and 3
  dimensions, 0-d tensors (empty box lists), boxes that only touch (a stop equal to the
  other's start: no overlap), pieces larger than the output and inside it, partial
  overlaps, float32, float64 and int64. out must end as the referee's (untouched where
  there is no overlap), the return value a real bool (True or False, not numpy's),
  piece and both boxes unchanged.

The round trip (both exercises, one process, float64): a tiny GPT (vocabulary 35, padded
at t = 2 and 3) trained 2 steps; its parameters and AdamW state cut as tensor-parallel
ranks of t = 2 and 3 hold them; each rank's pieces (minidist.checkpoint.layouts.held_pieces,
which calls minidist.parallel.pieces.tp_regions) saved as one checkpoint with
minidist.checkpoint.store.save; then loaded with layouts.load into one process (every
weight a box assembled from t pieces by read.read_region, which calls copy_overlap), and into the ranks of the other cut (t = 3
into 2 and 2 into 3: pieces that overlap a region in part). Every loaded weight and AdamW
moment must equal the saved one, bit for bit, and one more training step of the loaded
one-process model must give the uninterrupted run's loss and weights.

Then the plug-in check runs lesson 11 with the function plugged in (below): trained under
tensor parallelism on 2 ranks, saved, resumed under data parallelism, so the grader grades
this file at 2 ranks (mpirun -n 2).
"""
import json
import shutil
import tempfile

import numpy as np

from minidist.checkpoint import layouts, read, store
from minidist.parallel import pieces as model_pieces
from minidist.grader.checks import Exercise, yours
from minidist.grader.plugin import Run, plugged

# ----------------------------------------------------------------------------- referees


def _bounds(n, t):
    """numpy.array_split's offsets of n in t: [0, b1, ..., n] (the first n % t chunks one longer)."""
    q, r = divmod(n, t)
    return [c * q + min(c, r) for c in range(t + 1)]


def referee_regions(full_shape, spec, rank, t):
    """[(box, (start, stop) per dimension of the local shard)], in block order."""
    if spec is None:
        return [([[0, n] for n in full_shape], [(0, n) for n in full_shape])]
    axis = spec.axis
    real = spec.size if spec.size is not None else full_shape[axis]
    padded = spec.padded if spec.padded is not None else full_shape[axis]
    block = padded // spec.blocks
    cut = _bounds(block, t)
    mine = cut[rank + 1] - cut[rank]
    out = []
    for b in range(spec.blocks):
        g0 = b * block + cut[rank]
        g1 = min(g0 + mine, real)
        if g1 <= g0:
            continue
        box = [[0, n] for n in full_shape]
        box[axis] = [g0, g1]
        local = [(0, n) for n in full_shape]
        local[axis] = (b * mine, b * mine + g1 - g0)
        out.append((box, local))
    return out


def referee_copy(out, out_box, piece, piece_box):
    """out's expected values after the copy, and whether the boxes overlap."""
    want = out.copy()
    inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(out_box, piece_box)]
    if any(lo >= hi for lo, hi in inter):
        return want, False
    want[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, out_box))] = \
        piece[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, piece_box))]
    return want, True


# ----------------------------------------------------------------------------- 11.1 tp_regions

def _spec_text(spec):
    if spec is None:
        return "replicated (spec None)"
    pad = f", size {spec.size} padded to {spec.padded}" if spec.padded not in (None, spec.size) else ""
    return f"Shard(axis={spec.axis}, blocks={spec.blocks}{pad})"


def _tp_cases():
    """(full_shape, spec, t, what): every parameter of tiny GPTs under shard_specs, and cuts made up here."""
    from minidist.model import GPT, GPTConfig
    from minidist.parallel.tp_model import Shard, shard_specs
    configs = [GPTConfig(block_size=4, vocab_size=35, n_layer=1, n_head=2, n_embd=10, dtype="float64"),
               GPTConfig(block_size=4, vocab_size=24, n_layer=1, n_head=2, n_embd=6, bias=False, dtype="float64")]
    for cfg in configs:
        shapes = [(n, tuple(p.shape)) for n, p in GPT(cfg, seed=0).named_parameters()]
        for t in range(1, 6):
            specs = shard_specs(cfg, t)
            for name, shape in shapes:
                yield shape, specs.get(name), t, f"{name} {shape} of a GPT (vocab {cfg.vocab_size}, n_embd " \
                                                 f"{cfg.n_embd}{', no bias' if not cfg.bias else ''}), t = {t}"
    made = [((5, 3), Shard(0, size=5, padded=8), 4), ((5, 3), Shard(0, size=5, padded=8), 3),
            ((7,), Shard(0, size=7, padded=10), 5), ((2, 6), Shard(1, blocks=3), 4), ((6,), Shard(0, blocks=3), 3),
            ((3, 7, 2), Shard(1), 3), ((3, 4, 2), Shard(2), 3), ((), None, 2), ((4, 3), None, 3)]
    for shape, spec, t in made:
        yield shape, spec, t, f"a tensor {shape}, {_spec_text(spec)}, t = {t}"


def _ranges(index, shape):
    """(start, stop) per dimension of a tuple of step-1 slices into an array of `shape`, or None."""
    if not isinstance(index, tuple) or len(index) != len(shape):
        return None
    out = []
    for s, n in zip(index, shape):
        if not isinstance(s, slice):
            return None
        a, b, step = s.indices(n)
        if step != 1:
            return None
        out.append((a, max(a, b)))
    return out


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _form_problem(got, ndim, local_shape, what):
    """A sentence when got is not [(box, index)] of the right form, else None."""
    if not isinstance(got, (list, tuple)):
        return f"{what}: return a list of (box, index), got {type(got).__name__}"
    for k, item in enumerate(got):
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            return f"{what}: entry {k} is {item!r}: each entry is a pair (box, index)"
        box, index = item
        if not isinstance(box, (list, tuple)) or len(box) != ndim or \
                not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in box):
            return (f"{what}: entry {k}'s box is {box!r}: a box is a list of [start, stop], one per dimension "
                    f"of the tensor ({ndim})")
        if not all(_is_int(v) for p in box for v in p):
            kinds = sorted({type(v).__name__ for p in box for v in p if not _is_int(v)})
            return (f"{what}: entry {k}'s box holds {', '.join(kinds)}: write Python ints (int(...)); the "
                    "checkpoint's index is JSON, which takes no NumPy numbers")
        if _ranges(index, local_shape) is None:
            return (f"{what}: entry {k}'s index is {index!r}: a tuple of slices (step 1), one per dimension, "
                    "so that shard[index] is a view (loading writes through it)")
    return None


def _show(boxes):
    return "[" + ", ".join(str([list(p) for p in b]) for b in boxes) + "]"


def _tp_problem(got, full_shape, spec, rank, t, what):
    """A sentence saying what is wrong with got for one rank, or None."""
    from minidist.parallel.tp_model import shard
    ndim = len(full_shape)
    g = np.random.default_rng([len(full_shape), *full_shape, t])
    full = g.permutation(int(np.prod(full_shape, dtype=np.int64))).reshape(full_shape).astype(np.float64) + 1
    local = shard(full, spec, rank, t)
    problem = _form_problem(got, ndim, local.shape, what)
    if problem:
        return problem
    ref = referee_regions(full_shape, spec, rank, t)
    got_boxes = [[list(map(int, p)) for p in box] for box, _ in got]
    got_local = [_ranges(index, local.shape) for _, index in got]
    want_boxes = [b for b, _ in ref]
    want_local = [loc for _, loc in ref]
    said = (f"{what}: rank {rank} returned boxes {_show(got_boxes)} (shard of shape {local.shape}), expected "
            f"{_show(want_boxes)}")
    if spec is None and got_boxes != want_boxes:
        return f"{said} (spec None is replicated: every rank holds the whole tensor, one box of the whole)"
    for box in got_boxes:
        if any(not 0 <= a <= b <= n for (a, b), n in zip(box, full_shape)):
            pad = spec is not None and spec.padded not in (None, spec.size)
            return (f"{said}: the box {box} lies outside the tensor's shape {tuple(full_shape)}"
                    + (f" (the rows from {spec.size} to {spec.padded} are the vocabulary's zero padding: they "
                       "belong to no global tensor; cut them off the box and the index)" if pad else ""))
        if any(a >= b for a, b in box) and ndim:
            return f"{said}: the box {box} is empty: leave a chunk of nothing (or only padding) out"
    raw = [[[0 if s.start is None else s.start, n if s.stop is None else s.stop] for s, n in zip(index, full_shape)]
           for _, index in got]
    if raw == want_boxes and want_boxes != [[list(p) for p in loc] for loc in want_local]:
        return (f"{said}, indexes {raw} (the index is into this rank's LOCAL shard, of shape {local.shape}, "
                f"not into the global tensor of shape {tuple(full_shape)})")
    for box, loc in zip(got_boxes, got_local):
        if [b - a for a, b in box] != [b - a for a, b in loc]:
            return (f"{said}: the box {box} has shape {tuple(b - a for a, b in box)}, its index takes "
                    f"{tuple(b - a for a, b in loc)} of the shard: shard[index] must hold exactly global[box]")
    if len(got) != len(ref) and spec is not None and spec.blocks > 1:
        return (f"{said}: the axis holds {spec.blocks} blocks (c_attn's q | k | v), each cut in t: the rank "
                f"holds its chunk of every block, one box per block, not one box")
    wrong = next(((box, loc) for box, loc in zip(got_boxes, got_local)
                  if not np.array_equal(local[tuple(slice(a, b) for a, b in loc)],
                                        full[tuple(slice(a, b) for a, b in box)])), None)
    if wrong is not None or got_boxes != want_boxes or got_local != want_local:
        hint = ""
        if [[list(p) for p in loc] for loc in got_local] == want_boxes and got_local != want_local:
            hint = (" (the index is into this rank's LOCAL shard, of shape "
                    f"{local.shape}, not into the global tensor of shape {tuple(full_shape)})")
        elif got_boxes == [[list(p) for p in loc] for loc in want_local] and got_boxes != want_boxes:
            hint = (" (the box holds the offsets in the local shard: a box is where the rows lie in the GLOBAL "
                    "tensor, the index where they lie in the shard)")
        elif spec is not None and (spec.padded or full_shape[spec.axis]) // spec.blocks % t:
            hint = (f" (a block of {(spec.padded or full_shape[spec.axis]) // spec.blocks} is cut by "
                    "numpy.array_split's rule: the first n % t chunks one longer, minidist.comm.chunk_bounds)")
        if wrong is not None:
            box, loc = wrong
            return (f"{said}: shard[index] does not hold global[box] for the box {box} (index "
                    f"{[list(p) for p in loc]} of the shard){hint}")
        return f"{said}, indexes {[[list(p) for p in loc] for loc in got_local]} into the shard{hint}"
    return None


def _coverage_problem(all_boxes, full_shape, spec, t, what):
    """Every element of the global tensor covered exactly once by all ranks' boxes (a
    replicated tensor: by each rank's), or a sentence."""
    groups = [[b for boxes in all_boxes for b in boxes]] if spec is not None else all_boxes
    for boxes in groups:
        count = np.zeros(full_shape, np.int64)
        for box in boxes:
            count[tuple(slice(a, b) for a, b in box)] += 1
        if count.size and not np.all(count == 1):
            i = tuple(int(v) for v in np.argwhere(count != 1)[0])
            return (f"{what}: the boxes of the {t} ranks cover the element {i} of the global tensor "
                    f"{int(count[i])} times; every element exactly once")
    return None


def check_tp_regions(fn):
    import copy
    for full_shape, spec, t, what in _tp_cases():
        boxes = []
        for rank in range(t):
            spec_before = copy.deepcopy(vars(spec)) if spec is not None else None
            shape_in = tuple(full_shape)
            got = yours(fn, shape_in, spec, rank, t)
            if shape_in != tuple(full_shape) or (spec is not None and vars(spec) != spec_before):
                raise AssertionError(f"{what}: tp_regions changed the spec it was given: leave its inputs as "
                                     "they are")
            problem = _tp_problem(got, full_shape, spec, rank, t, what)
            if problem:
                raise AssertionError(problem)
            boxes.append([[list(map(int, p)) for p in box] for box, _ in got])
        problem = _coverage_problem(boxes, full_shape, spec, t, what)
        if problem:
            raise AssertionError(problem)
    _round_trips("tp_regions", fn)


# ----------------------------------------------------------------------------- 11.2 copy_overlap

def _random_box(g, shape):
    box = []
    for n in shape:
        a = int(g.integers(0, n))
        box.append([a, int(g.integers(a + 1, n + 1))])
    return box


def _copy_cases():
    """(out_box, piece_box, global shape, dtype, what)."""
    dtypes = (np.float64, np.float32, np.int64)
    g = np.random.default_rng(1111)
    for k in range(60):
        ndim = 1 + k % 3
        shape = tuple(int(v) for v in g.integers(3, 9, size=ndim))
        yield _random_box(g, shape), _random_box(g, shape), dtypes[k % 3], f"random boxes in {ndim}-D"
    fixed = [
        ([], [], "a 0-d tensor (both boxes [])"),
        ([[0, 4]], [[4, 7]], "boxes that only touch ([0, 4) and [4, 7): no element in common)"),
        ([[4, 7]], [[0, 4]], "boxes that only touch ([4, 7) and [0, 4))"),
        ([[0, 3], [2, 5]], [[0, 3], [5, 8]], "2-D boxes that touch along the second axis"),
        ([[0, 3], [2, 5]], [[3, 6], [0, 8]], "2-D boxes that touch along the first axis"),
        ([[2, 4], [1, 3]], [[0, 6], [0, 5]], "a piece larger than the output (it holds it whole)"),
        ([[0, 6], [0, 5]], [[2, 4], [1, 3]], "a piece inside the output"),
        ([[1, 5], [2, 6]], [[3, 8], [0, 4]], "a partial overlap in 2-D"),
        ([[3, 8], [0, 4]], [[1, 5], [2, 6]], "a partial overlap in 2-D, the other way round"),
        ([[0, 4], [0, 3]], [[0, 4], [0, 3]], "the same box"),
        ([[0, 2], [0, 3]], [[2, 4], [0, 3]], "the next rows (a row-parallel shard's neighbour)"),
        ([[0, 4], [0, 6]], [[0, 4], [6, 9]], "the next columns (no overlap)"),
        ([[0, 4], [0, 6]], [[5, 7], [1, 2]], "apart in one axis, overlapping in the other"),
        ([[1, 3], [0, 2], [2, 5]], [[0, 2], [1, 4], [0, 3]], "a partial overlap in 3-D"),
        ([[1, 3], [0, 2], [2, 5]], [[0, 2], [1, 4], [5, 6]], "3-D boxes that touch along the last axis"),
        ([[3, 9]], [[0, 20]], "1-D, a piece larger than the output"),
        ([[3, 9]], [[5, 6]], "1-D, one element inside"),
    ]
    for k, (ob, pb, what) in enumerate(fixed):
        for dtype in dtypes[:2] if k else dtypes:
            yield ob, pb, dtype, what


def _array(g, box, dtype, offset):
    shape = tuple(b - a for a, b in box)
    if np.dtype(dtype).kind == "i":
        return np.array(g.integers(0, 1000, size=shape) + offset, dtype=dtype)
    return np.array(g.standard_normal(shape) + offset, dtype=dtype)


def _copy_hint(got_out, out, out_box, piece, piece_box):
    """Why out differs, when a known slip explains it."""
    inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(out_box, piece_box)]
    variants = {
        "piece's part was taken at offsets relative to out_box: in piece, the overlap starts at its start minus "
        "piece_box's start": ([(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, out_box)],) * 2,
        "the overlap was written at offsets relative to piece_box: in out, it starts at its start minus "
        "out_box's start": ([(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, piece_box)],) * 2,
        "the offsets are swapped: out's are the overlap minus out_box's start, piece's minus piece_box's": (
            [(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, piece_box)],
            [(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, out_box)]),
    }
    for hint, (o_rng, p_rng) in variants.items():
        want = out.copy()
        try:
            src = piece[tuple(slice(max(a, 0), b) for a, b in p_rng)]
            dst = tuple(slice(max(a, 0), b) for a, b in o_rng)
            if want[dst].shape != src.shape:
                continue
            want[dst] = src
        except (ValueError, IndexError):
            continue
        if np.array_equal(got_out, want):
            return f" ({hint})"
    return ""


def check_copy_overlap(fn):
    from minidist.grader.referee import said, where
    g = np.random.default_rng(7)
    for out_box, piece_box, dtype, what in _copy_cases():
        out = _array(g, out_box, dtype, 0)
        piece = _array(g, piece_box, dtype, 5000)
        before, piece_before = out.copy(), piece.copy()
        boxes_before = json.dumps([out_box, piece_box])
        want, overlap = referee_copy(out, out_box, piece, piece_box)
        where_ = (f"{what}: out_box {out_box}, piece_box {piece_box}, {np.dtype(dtype).name}")
        try:
            got = yours(fn, out, out_box, piece, piece_box)
        except AssertionError:
            raise
        except Exception as e:
            hint = (" (copy only the overlap: clip both to it, [max(starts), min(stops)) per dimension)"
                    if isinstance(e, ValueError) and "broadcast" in str(e) else "")
            raise AssertionError(f"{where_}: your copy_overlap raised {said(e)}{where(e)}{hint}") from None
        if not np.array_equal(piece, piece_before):
            raise AssertionError(f"{where_}: copy_overlap changed piece: write into out only (out[...] = "
                                 "piece[...], not the other way round)")
        if json.dumps([out_box, piece_box]) != boxes_before:
            raise AssertionError(f"{where_}: copy_overlap changed the boxes it was given: leave them as they are")
        if got is None:
            raise AssertionError(f"{where_}: copy_overlap returned None: return True when the boxes overlap, "
                                 "False otherwise")
        if not isinstance(got, bool):
            raise AssertionError(f"{where_}: copy_overlap returned {got!r} ({type(got).__module__}."
                                 f"{type(got).__name__}): return a bool, True or False (bool(...) around a "
                                 "NumPy result)")
        if got != overlap:
            touch = not overlap and all(max(a, c) <= min(b, d) for (a, b), (c, d) in zip(out_box, piece_box))
            raise AssertionError(f"{where_}: copy_overlap returned {got}, expected {overlap}"
                                 + (" (boxes that only touch share no element: a stop is not inside the box, "
                                    "so [a, b) and [b, c) do not overlap)" if touch else ""))
        if not overlap and not np.array_equal(out, before):
            raise AssertionError(f"{where_}: the boxes do not overlap, yet out was changed: leave it as it is")
        if out.dtype != np.dtype(dtype) or not np.array_equal(out, want):
            bad = np.argwhere(out != want)
            first = (f" (first difference at {[int(v) for v in bad[0]]}: {out[tuple(bad[0])].item()!r}, expected "
                     f"{want[tuple(bad[0])].item()!r})") if bad.size and out.ndim else ""
            unchanged = (" (out is unchanged: write into it in place, out[...] = ..., not a new array bound to "
                         "the name out)" if np.array_equal(out, before) else "")
            raise AssertionError(f"{where_}: out differs from the expected copy{first}"
                                 f"{unchanged or _copy_hint(out, before, out_box, piece, piece_box)}")
    _round_trips("copy_overlap", fn)


# ----------------------------------------------------------------------------- the round trip

class _Ranks:
    """What minidist.checkpoint.layouts needs of a tensor-parallel rank: the GPT's parameters
    cut as TensorParallelGPT cuts them (tp_model.shard), its AdamW state cut alike, and the
    specs (in one process, without a communicator: the ranks are simulated here)."""

    def __init__(self, full, full_opt, rank, t, empty=False):
        from minidist.nn import Parameter
        from minidist.parallel.tp_model import shard, shard_specs
        self.tp, self.tp_rank = t, rank
        self.specs = shard_specs(full.config, t)
        whole = list(full.named_parameters())
        self.full_shapes = {n: tuple(p.shape) for n, p in whole}
        self.named = []
        self.state = {}
        for n, p in whole:
            spec = self.specs.get(n)
            q = Parameter(shard(p.data, spec, rank, t) * (0 if empty else 1))
            self.named.append((n, q))
            s = full_opt.state.get(id(p))
            if s is not None and not empty:
                self.state[id(q)] = {"step": s["step"], "exp_avg": shard(s["exp_avg"], spec, rank, t),
                                     "exp_avg_sq": shard(s["exp_avg_sq"], spec, rank, t)}

    @property
    def tensor_parallel(self):      # as TensorParallelGPT: the model says how it is cut
        return self

    def named_parameters(self):
        return list(self.named)

    def parameters(self):
        return [p for _, p in self.named]

    # ... and of its optimizer (optim.Optimizer's checkpoint hooks): AdamW's state, as `state`
    def adamw(self):
        return None

    def checkpoint_params(self, params):
        return list(params)

    def checkpoint_loaded(self):
        pass


CFG = dict(block_size=6, vocab_size=35, n_layer=1, n_head=2, n_embd=10, dtype="float64")
LR = 1e-2


def _trained(seed=0, steps=2):
    from minidist.model import GPT, GPTConfig
    model = GPT(GPTConfig(**CFG), seed=seed)
    opt = model.configure_optimizers(0.1, LR)
    for step in range(steps):
        _step(model, opt, step)
    return model, opt


def _step(model, opt, step):
    from minidist.train import micro_batches, train_step
    g = np.random.default_rng([3, step])
    x, y = g.integers(0, CFG["vocab_size"], size=(2, CFG["block_size"])), \
        g.integers(0, CFG["vocab_size"], size=(2, CFG["block_size"]))
    return train_step(model, opt, micro_batches(x, y, step, 0), LR, 1.0)[0]


def _save_tp(root, full, opt, t):
    """Checkpoint step 2 of (full, opt) as t tensor-parallel ranks write it, each replicated
    region once (as layouts.writers chooses); returns its path."""
    pieces, seen = [], set()
    for rank in range(t):
        ranks = _Ranks(full, opt, rank, t)
        held, _ = layouts.held_pieces(ranks, ranks)
        for h in held:
            key = json.dumps(h.key())
            if key in seen:
                continue
            seen.add(key)
            pieces.append({"name": h.name, "global_shape": h.shape, "dtype": h.local.dtype,
                           "array": np.asarray(h.local, order="C"), **h.region})
    pieces.append({"name": layouts.STEP, "global_shape": (), "dtype": np.dtype(np.int64),
                   "array": np.array(2, np.int64), "box": []})
    meta = {"train_step": 2, "optimizer_step": 2, "layout": {"kind": "tensor_parallel", "ranks": t}}
    return store.save(None, root, 2, pieces, meta)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def _round_trip(t_save, t_load):
    """Save (trained GPT) as t_save ranks; load into one process and into t_load ranks.
    Returns a problem sentence or None."""
    from mpi4py import MPI
    from minidist.model import GPT, GPTConfig
    from minidist.parallel.tp_model import shard
    full, opt = _trained()
    root = tempfile.mkdtemp(prefix="minidist-ex11-")
    try:
        path = _save_tp(root, full, opt, t_save)
        # into one process: fresh weights (another seed), no AdamW state yet
        one = GPT(GPTConfig(**CFG), seed=5)
        one_opt = one.configure_optimizers(0.1, LR)
        layouts.load(MPI.COMM_SELF, path, one, one_opt)
        saved = dict(full.named_parameters())
        for n, p in one.named_parameters():
            if not _same(p.data, saved[n].data):
                return f"the weight {n} loaded into one process differs from the one saved"
            s, w = one_opt.state.get(id(p)), opt.state[id(saved[n])]
            if s is None or int(s["step"]) != int(w["step"]):
                return f"the AdamW step count of {n} loaded into one process is not the saved {w['step']}"
            for k in ("exp_avg", "exp_avg_sq"):
                if not _same(s[k], w[k]):
                    return f"AdamW's {k} of {n} loaded into one process differs from the one saved"
        # resume: one more step, loaded against uninterrupted
        a, b = _step(one, one_opt, 2), _step(full, opt, 2)
        if a != b:
            return f"the step after the load has loss {a!r}, the uninterrupted run {b!r}"
        if any(not _same(p.data, saved[n].data) for n, p in one.named_parameters()):
            return "the weights after one more step differ from the uninterrupted run's"
        # into another cut: t_load ranks, their shards zero before the load
        full, opt = _trained()
        for rank in range(t_load):
            ranks = _Ranks(full, opt, rank, t_load, empty=True)
            layouts.load(MPI.COMM_SELF, path, ranks, ranks)
            for (n, q), (_, p) in zip(ranks.named, full.named_parameters()):
                spec = ranks.specs.get(n)
                if not _same(q.data, shard(p.data, spec, rank, t_load)):
                    return f"rank {rank} of {t_load}'s shard of {n} differs from the saved weight's"
                s, w = ranks.state[id(q)], opt.state[id(p)]
                for k in ("exp_avg", "exp_avg_sq"):
                    if not _same(s[k], shard(w[k], spec, rank, t_load)):
                        return f"rank {rank} of {t_load}'s shard of AdamW's {k} of {n} differs from the saved one"
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _round_trips(name, fn):
    """The round trips with fn plugged into the package in place of the package's `name`."""
    from minidist.grader.referee import said, where
    from minidist.checkpoint.format import CheckpointError
    module = model_pieces if name == "tp_regions" else read
    for t_save, t_load in ((2, 3), (3, 2)):
        setting = (f"a tiny GPT (vocabulary 35, float64) trained 2 steps, saved as {t_save} tensor-parallel "
                   f"ranks, loaded into one process and into {t_load} ranks, with your {name} in "
                   f"{module.__name__}")
        with plugged(getattr(module, name), fn):
            try:
                problem = _round_trip(t_save, t_load)
            except AssertionError:
                raise
            except CheckpointError as e:
                problem = f"the checkpoint refused it: {e}"
            except Exception as e:
                problem = f"crashed: {said(e)}{where(e)}"
        if problem:
            raise AssertionError(f"{setting}: {problem} (the package's own {name} round-trips bit for bit)")


# ----------------------------------------------------------------------------- the exercises

# The plug-in check (minidist/grader/plugin.py) runs lesson 11 with the function plugged in:
# a tiny GPT trained under tensor parallelism on 2 ranks (its c_attn in three blocks, each
# cut in 2), saved (layouts.held_pieces calls tp_regions), then resumed under data
# parallelism on the same 2 ranks, each reading whole tensors assembled from the TP
# pieces (read.read_region calls copy_overlap), and trained on: its losses and final
# weights must match one process trained without a stop. A wrong answer there makes the
# lesson crash (a box outside the tensor, pieces that overlap) or MISMATCH. The check's own
# round trips (above) add what this run does not reach: t = 3, a padded vocabulary, a
# TP 3 -> TP 2 reshard.
LESSON = "11_checkpoints"
RUNS = (Run(LESSON, lambda n: ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8",
                               "--batch-size", str(2 * n), "--steps", "4", "--save-every", "2", "--no-kill",
                               "--save-layout", "tp", "--resume-layout", "dp"), ranks=2),)

EXERCISES = [
    Exercise("11.1", "tp_regions", model_pieces.tp_regions, check_tp_regions, runs=RUNS),
    Exercise("11.2", "copy_overlap", read.copy_overlap, check_copy_overlap, runs=RUNS),
]
