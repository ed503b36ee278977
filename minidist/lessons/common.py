"""What the training lessons share beyond the harness: model and data flags, the data set,
and the comparison's printout.

Training the reference and the parallel run alike, and comparing them, is
minidist/equivalence.py (`train_and_collect`, `compare_by_kind`, `mpi_reduce`): its names
are imported here, so lessons keep writing `common.train_and_collect`.
"""
import numpy as np

from minidist.cli import (WIDTH, InputError, agreed_need, command_with, need, nonnegative_float,
                          positive_float, positive_int, ranks, say, table)
from minidist.equivalence import (COMPARED, KINDS, compare_by_kind, gradient_factor,  # noqa: F401
                                  mpi_reduce, train_and_collect, where)
from minidist.lessons.harness import heads_fix, physical_memory


def add_model_flags(p, n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=8, dropout=0.0):
    """The GPT's shape, the global batch and the data: flags shared by the training lessons."""
    g = p.add_argument_group("model and data")
    g.add_argument("--n-layer", type=positive_int, default=n_layer)
    g.add_argument("--n-head", type=positive_int, default=n_head)
    g.add_argument("--n-embd", type=positive_int, default=n_embd)
    g.add_argument("--block-size", type=positive_int, default=block_size, help="sequence length T")
    g.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help="the global batch in sequences (default %(default)s)")
    g.add_argument("--dropout", type=float, default=dropout, help="dropout probability in [0, 1)")
    g.add_argument("--data", metavar="PATH", help="a UTF-8 text file (default: Python stdlib source)")
    return g


def add_step_flags(p, grad_accum=False, clip_off=True):
    """The optimizer step's flags: --lr, --grad-clip and, where the lesson accumulates,
    --grad-accum. clip_off=False: a lesson whose figures need clipping on (0 refused)."""
    if grad_accum:
        p.add_argument("--grad-accum", type=positive_int, default=1,
                       help="micro-batches per rank per step, one gradient sync per step (default %(default)s)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--grad-clip", type=nonnegative_float if clip_off else positive_float, default=0.5,
                   help="clip the global gradient norm" + (" (0: off)" if clip_off else "") + " (default %(default)s)")


def config_from_args(args, ranks=1):
    """GPTConfig from the flags; a shape that cannot work is an InputError.

    That includes a shape whose activations cannot fit in this machine's memory, split
    among the `ranks` that share it (the batch is cut among them too).
    """
    from minidist.model import GPTConfig
    need(0.0 <= args.dropout < 1.0, f"--dropout must be in [0, 1), got {args.dropout}")
    cfg = GPTConfig(block_size=args.block_size, vocab_size=256, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, dtype=args.dtype)
    try:
        cfg.validate()
    except ValueError as e:
        fix = heads_fix(cfg.n_head, cfg.n_embd)
        raise InputError(f"{e}; this works: {command_with(ranks, fix)}" if fix else str(e))
    need_bytes = activation_bytes(cfg, max(1, args.batch_size // ranks)) * ranks
    have = physical_memory()
    need(have is None or need_bytes < 0.8 * have,
         f"this shape needs about {need_bytes / 2**30:.1f} GiB for activations on {ranks} rank(s), more than "
         f"this machine's {(have or 0) / 2**30:.1f} GiB: use a smaller --block-size, --batch-size or model")
    return cfg


def batch_rows(args, rank, world):
    """This data-parallel rank's rows of the global batch; a batch that does not split over
    `world` ranks and --grad-accum micro-batches is bad input (one message, exit 2)."""
    from minidist.data import shard_slice
    try:
        return shard_slice(args.batch_size, rank, world, args.grad_accum)
    except ValueError as e:
        unit = world * args.grad_accum                     # the next batch that splits
        works = command_with(world, {"--batch-size": -(-args.batch_size // unit) * unit})
        raise InputError(f"--batch-size {args.batch_size} with {world} ranks and --grad-accum "
                         f"{args.grad_accum}: {e}; this works: {works}")


def activation_bytes(cfg, batch):
    """A rough upper bound of what one training step saves for backward, in bytes.

    Per layer: about 20 arrays of (B, T, C) (inputs of the matmuls, layer norms, GELU)
    and 2 of (B, nh, T, T) (attention probabilities and their dropout mask); then the
    (B, T, V) logits and their softmax.
    """
    B, T, C = batch, cfg.block_size, cfg.n_embd
    per_layer = 20 * B * T * C + 2 * B * cfg.n_head * T * T
    return (cfg.n_layer * per_layer + 2 * B * T * cfg.vocab_size) * np.dtype(cfg.dtype).itemsize


def load_dataset(args, comm=None):
    """The Dataset for --data (or the default corpus) at --block-size; errors -> InputError.

    With a communicator, the ranks agree first: a file missing on one node's disk stops
    every rank with the message, instead of one rank leaving while the others wait.
    """
    from minidist.data import Dataset, DataError, load_text
    error, dataset = None, None
    try:
        dataset = Dataset.from_text(load_text(args.data), args.block_size, seed=args.seed)
    except DataError as e:
        error = str(e)
    if comm is not None:
        agreed_need(comm, error is None, error or f"--data {args.data} could not be read")
    elif error:
        raise InputError(error)
    return dataset


def report_comparison(comm, against, ref_losses, losses, state, ref_state, tol, notes=(),
                      show_where=None, loss_label=None):
    """Print, on rank 0, what was compared and each kind's max_rel_diff (the largest over ranks).

    against: "4 ranks", "tp=8", ...; notes: lines on how the pieces were lined up (shards,
    partitions); show_where: None to leave out which tensor differs most, "" to name it,
    " on rank 0" to name rank 0's (where each rank compares its own pieces).
    """
    say(f"\nwhat was compared, one process against {against}:")
    for line in COMPARED + tuple(notes):
        say(f"  - {line}")
    table([[s, f"{a:.6f}", f"{b:.6f}"] for s, (a, b) in enumerate(zip(ref_losses, losses))],
          header=["step", "loss 1 process", loss_label or f"loss {ranks(comm.Get_size())}"])
    for kind, r, _, w in compare_by_kind(state, ref_state):
        r = mpi_reduce(comm, r)
        worst = f"  (largest in {where(w)}{show_where})" if show_where is not None and ":" in w else ""
        head, verdict = f"  {kind:<13} max_rel_diff {r:.1e}", "" if r <= tol else "  OUTSIDE the tolerance"
        if len(head + worst + verdict) <= WIDTH:
            say(head + worst + verdict)
        else:                                       # the tensor's name on a line of its own
            say(head + verdict + f"\n  {'':<13} {worst.strip()}")
