"""Exercise 11: sharded checkpoints: which boxes a tensor-parallel rank holds, and how one
piece of a saved tensor fills a region of another layout.

Two functions, each mirroring the package's by name and signature:

- 11.1 `tp_regions` (minidist/parallel/pieces.py): the boxes of a global tensor that a
  tensor-parallel rank holds, and where each lies in its local shard. Saving writes these
  boxes; loading asks the checkpoint for exactly them.
- 11.2 `copy_overlap` (minidist/checkpoint/read.py): resharding, one piece at a time:
  copy the part of a saved piece that lies inside the region a rank asks for.

Both are plain NumPy in one process; the grader grades the file at 2 ranks, because
lesson 11 runs with your function plugged in on 2:

    mpirun -n 2 python -m minidist.grade lessons/exercises/11_checkpoints.py

After the unit checks, each check plugs your function into the package and saves and
loads real checkpoints with it (a tiny GPT trained a few steps, cut for tensor
parallelism in 2 and 3, loaded into one process and into another cut), against the
package's own answer, bit for bit; then lesson 11 trains under tensor parallelism on 2
ranks, saves, resumes under data parallelism and must match one process without a stop.
Leave the inputs unchanged (copy_overlap writes into `out` only).

A box is a list of [start, stop] per dimension of the GLOBAL tensor (as saved: the one
process's shape, no padding), stop excluded: [[0, 4], [3, 6]] is rows 0..3 of columns
3..5. A 0-d tensor's box is [].
"""
import numpy as np  # noqa: F401  (you will want it)

from minidist.plan.rules import chunk_bounds  # noqa: F401  (array_split's offsets: [0, b1, ..., n])


def tp_regions(full_shape, spec, rank, t):
    """[(box, index)]: the regions of the global tensor that tensor-parallel rank `rank` of
    t holds, and where each lies in its local shard.

    full_shape: the global tensor's shape (a tuple). spec: how the parameter is cut, a
    minidist.parallel.tp_model.Shard(axis, blocks=1, size=None, padded=None), or None:
      None: replicated: every rank holds the whole tensor: one box of the whole, and the
          index takes all of the shard (a slice(None) per dimension);
      a Shard: along `axis`, the tensor is first padded with zero rows from `size` to
          `padded` (the vocabulary, padded to a multiple of t; size None: no padding),
          then cut into `blocks` equal blocks (c_attn's columns q | k | v are 3), and each
          block is cut in t by numpy.array_split's rule (minidist.plan.rules.chunk_bounds: the
          first n % t chunks one longer). Rank r's shard is its chunk of every block,
          concatenated in block order (minidist.parallel.tp_model.shard builds it).
    Returns one (box, index) per block whose chunk holds any real row:
      box: [[start, stop], ...], one pair of Python ints per dimension, in the GLOBAL
          (unpadded) tensor;
      index: a tuple of slices, one per dimension, into this rank's LOCAL shard, so that
          shard[index] holds exactly global[box].
    Rows that are only padding belong to no global tensor: cut them off the box (and the
    index); a box is never empty (a chunk of nothing but padding gives no entry).
    """
    raise NotImplementedError("exercise 11.1: tp_regions")


def copy_overlap(out, out_box, piece, piece_box):
    """Copy into `out` (in place) the part of `piece` that lies inside out_box; True when the
    two regions overlap, False otherwise.

    out holds the region out_box of a global tensor (out.shape is the box's size), piece
    the region piece_box of the same tensor; each box a list of [start, stop] per
    dimension (stop excluded; [] for a 0-d tensor). The overlap is, per dimension,
    [max(starts), min(stops)); the regions overlap when it is non-empty in EVERY dimension
    (boxes that only touch, one's stop the other's start, share nothing). Write the
    overlap's values from piece into out, each at its own offsets (the overlap's start
    minus out_box's start in out, minus piece_box's start in piece). With no overlap,
    return False and leave out as it is. Never write into piece. Return a bool.
    """
    raise NotImplementedError("exercise 11.2: copy_overlap")
