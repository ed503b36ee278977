"""The process grid: tp x pp x dp ranks, and one sub-communicator per kind of parallelism.

    grid = ProcessGrid(tp=2, pp=2)          # with 8 ranks: dp = 8 / (2*2) = 2
    print(grid)                             # the table below, on every rank that prints

Every rank has coordinates (dp_rank, pp_rank, tp_rank) with tp varying fastest:

    rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank

so the ranks of one tensor-parallel group are neighbours (on a cluster, GPUs of one
node, where the all-reduces of every layer run over the fastest links), the pipeline
stages of one replica come next, and data-parallel replicas are furthest apart.
Ranks that share all coordinates but one form that one's group:

    tp_comm: same dp and pp, tp_rank 0..tp-1    (Megatron's tensor-parallel group)
    pp_comm: same dp and tp, pp_rank 0..pp-1    (the stages of one pipeline)
    dp_comm: same pp and tp, dp_rank 0..dp-1    (replicas that average gradients)

The grid is passed explicitly to whoever needs it; there is no global one.
"""
from mpi4py import MPI

from minidist.comm.watchdog import waiting
from minidist.failfast import AgreedError


class GridError(AgreedError):
    """tp * pp * dp does not fit the world: every rank finds this alike."""


class ProcessGrid:
    def __init__(self, tp=1, pp=1, dp=None, comm=None):
        if comm is None:           # COMM_WORLD, its sends delayed when MINIDIST_LINKS is set
            from minidist.comm.links import from_environment
            comm = from_environment()
        self.world = comm
        size = self.world.Get_size()
        for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise GridError(f"{name} must be a whole number of at least 1, got {v!r}")
        if dp is None:
            if size % (tp * pp):
                raise GridError(f"tp={tp} x pp={pp} = {tp * pp} ranks per replica does not divide "
                                f"the {size} ranks of the world; run with a multiple of {tp * pp} ranks")
            dp = size // (tp * pp)
        if tp * pp * dp != size:
            raise GridError(f"tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} ranks, but the world has "
                            f"{size}; choose sizes whose product is {size}")
        self.tp, self.pp, self.dp = tp, pp, dp
        self.size, self.rank = size, self.world.Get_rank()
        self.dp_rank, self.pp_rank, self.tp_rank = self.coords(self.rank)
        # Split(color, key): ranks with the same color form one group, ordered by key. A
        # group is named by its first member (groups of one kind do not overlap), and my key
        # is my place in it, so the communicators are exactly what grid_group says.
        with waiting("ProcessGrid: Split of the world into tp, pp and dp groups"):
            self.tp_comm, self.pp_comm, self.dp_comm = (self._split(kind) for kind in ("tp", "pp", "dp"))

    def _split(self, kind):
        group = [int(r) for r in grid_group(self.rank, kind, self.tp, self.pp, self.dp)]
        return self.world.Split(group[0], group.index(self.rank))

    # ----------------------------------------------------------------------- coordinates

    def coords(self, rank):
        """(dp_rank, pp_rank, tp_rank) of a world rank."""
        return grid_coords(rank, self.tp, self.pp, self.dp)

    def rank_of(self, dp_rank, pp_rank, tp_rank):
        """The world rank at these coordinates."""
        return dp_rank * self.pp * self.tp + pp_rank * self.tp + tp_rank

    def tp_group(self, rank=None):
        """The world ranks in the tensor-parallel group of `rank` (default: mine)."""
        return grid_group(self.rank if rank is None else rank, "tp", self.tp, self.pp, self.dp)

    def pp_group(self, rank=None):
        return grid_group(self.rank if rank is None else rank, "pp", self.tp, self.pp, self.dp)

    def dp_group(self, rank=None):
        return grid_group(self.rank if rank is None else rank, "dp", self.tp, self.pp, self.dp)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1

    def free(self):
        """Release the sub-communicators (MPI keeps them until then)."""
        for c in (self.tp_comm, self.pp_comm, self.dp_comm):
            if c != MPI.COMM_NULL:
                c.Free()

    # ----------------------------------------------------------------------- printing

    def __repr__(self):
        return f"ProcessGrid(tp={self.tp}, pp={self.pp}, dp={self.dp})"

    def __str__(self):
        """A table: every rank, its coordinates, and the ranks it shares each group with."""
        head = ("rank", "dp", "pp", "tp", "tp group", "pp group", "dp group")
        rows = [head]
        for r in range(self.size):
            d, p, t = self.coords(r)
            rows.append((str(r), str(d), str(p), str(t), _ranks(self.tp_group(r)),
                         _ranks(self.pp_group(r)), _ranks(self.dp_group(r))))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = [f"{self!r} on {self.size} ranks (tp varies fastest)"]
        for n, row in enumerate(rows):
            lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
            if n == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def grid_coords(rank, tp, pp, dp):
    """(dp_rank, pp_rank, tp_rank) of `rank` on a tp x pp x dp grid, tp varying fastest:
    rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank. (Exercise 7.1.)"""
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def grid_group(rank, kind, tp, pp, dp):
    """The world ranks of `rank`'s `kind` group ("tp", "pp" or "dp"), in that group's rank
    order: every coordinate but `kind`'s fixed to `rank`'s. (Exercise 7.2.)"""
    d, p, t = grid_coords(rank, tp, pp, dp)
    at = lambda d, p, t: d * pp * tp + p * tp + t      # noqa: E731
    if kind == "tp":
        return [at(d, p, i) for i in range(tp)]
    if kind == "pp":
        return [at(d, i, t) for i in range(pp)]
    if kind == "dp":
        return [at(i, p, t) for i in range(dp)]
    raise ValueError(f"kind must be 'tp', 'pp' or 'dp', not {kind!r}")


def _ranks(group):
    return "[" + " ".join(str(r) for r in group) + "]"
