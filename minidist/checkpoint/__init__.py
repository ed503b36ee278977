"""Checkpoints of a training run: sharded, atomic, verified, loadable under another layout.

    python -m minidist.checkpoint show CKPT        # what is in it, which rank wrote what
    python -m minidist.checkpoint verify CKPT      # every file against the index's checksums
    python -m minidist.checkpoint export CKPT out.safetensors   # nanoGPT / PyTorch names and layout
    python -m minidist.checkpoint import FILE CKPT

Files, in reading order:
    format.py    safetensors, written and read by hand (no code runs on load; PyTorch reads it)
    index.py     what a checkpoint is on disk: pieces (boxes, flat ranges), index.json,
                 `latest`, and the coverage rule (every element written exactly once)
    store.py     save: every rank its pieces, then one index, published atomically
    read.py      resolve, read a global tensor or a region of it (only the bytes that
                 overlap), verify
    layouts.py   which pieces of which global tensors a rank holds under each strategy
                 (the strategies' hooks; a model's pieces: minidist/parallel/pieces.py), and
                 how it fills its model and optimizer from a checkpoint saved under any other
    cli.py       the command line above

"Checkpoint" means two things in this field, and minidist has both, under two names. This
package is the saved state of a run (PyTorch's torch.distributed.checkpoint). The older
meaning is activation checkpointing (PyTorch's torch.utils.checkpoint), lesson 08's
`minidist.recompute.checkpoint(fn, *inputs)`: it lives in minidist/recompute.py.
"""
