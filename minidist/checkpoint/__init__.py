"""Checkpoints of a training run: sharded, atomic, verified, loadable under another layout.

    python -m minidist.checkpoint show CKPT        # what is in it, which rank wrote what
    python -m minidist.checkpoint verify CKPT      # every file against the index's checksums
    python -m minidist.checkpoint export CKPT out.safetensors   # nanoGPT / PyTorch names and layout
    python -m minidist.checkpoint import FILE CKPT

Files, in reading order:
    format.py    safetensors, written and read by hand (no code runs on load; PyTorch reads it)
    store.py     save (every rank its pieces, then one index, published atomically), resolve,
                 read a global tensor or a region of it, verify
    layouts.py   which pieces of which global tensors a rank holds under each strategy, and
                 how it fills its model and optimizer from a checkpoint saved under any other
    cli.py       the command line above

"Checkpoint" means two things in this field, and minidist has both. This package is the
saved state of a run (PyTorch's torch.distributed.checkpoint). The older meaning is
activation checkpointing, lesson 08's `minidist.checkpoint(fn, *inputs)` (PyTorch's
torch.utils.checkpoint): that call still works, because this module is callable and
hands such a call to minidist.recompute.checkpoint.
"""
import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, fn, *inputs):
        """minidist.checkpoint(fn, *inputs): activation recomputation (minidist/recompute.py)."""
        from minidist.recompute import checkpoint
        return checkpoint(fn, *inputs)


sys.modules[__name__].__class__ = _CallableModule
