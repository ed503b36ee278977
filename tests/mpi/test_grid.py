"""ProcessGrid: coordinates with tp fastest, the three groups, and clear errors.

    mpirun -n 8 python -m pytest -q --only-mpi tests/mpi/test_grid.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import GridError, ProcessGrid

pytestmark = pytest.mark.mpi


def factorizations(size):
    return [(tp, pp) for tp in range(1, size + 1) for pp in range(1, size + 1) if size % (tp * pp) == 0]


def members(sub, world):
    """The world ranks in sub-communicator `sub`, in its rank order (MPI's own Allgather)."""
    mine = np.array([world.Get_rank()], dtype=np.int64)
    everyone = np.empty(sub.Get_size(), dtype=np.int64)
    sub.Allgather(mine, everyone)
    return everyone.tolist()


def test_every_factorization(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for tp, pp in factorizations(size):
        g = ProcessGrid(tp=tp, pp=pp)
        dp = size // (tp * pp)
        where = f"grid tp={tp} pp={pp} dp={dp}, rank {rank}"
        assert (g.tp, g.pp, g.dp) == (tp, pp, dp), where
        assert rank == g.dp_rank * pp * tp + g.pp_rank * tp + g.tp_rank, f"{where}: tp must vary fastest"
        assert g.rank_of(g.dp_rank, g.pp_rank, g.tp_rank) == rank
        for name, sub, want_rank, group in (("tp", g.tp_comm, g.tp_rank, g.tp_group()),
                                            ("pp", g.pp_comm, g.pp_rank, g.pp_group()),
                                            ("dp", g.dp_comm, g.dp_rank, g.dp_group())):
            assert sub.Get_rank() == want_rank, f"{where}: my rank in {name}_comm is {sub.Get_rank()}"
            assert members(sub, comm) == group, \
                f"{where}: {name}_comm holds ranks {members(sub, comm)}, expected {group}"
        g.free()


def test_dp_is_inferred_and_str_is_a_table(comm):
    g = ProcessGrid()
    assert (g.tp, g.pp, g.dp) == (1, 1, comm.Get_size())
    text = str(g)
    assert "tp group" in text and len(text.splitlines()) == comm.Get_size() + 3, text
    g.free()


@pytest.mark.parametrize("kw,says", [
    (dict(tp=3, pp=3), "tp=3 x pp=3 = 9 ranks per replica does not divide the {size} ranks"),
    (dict(tp=1, pp=1, dp=99), "tp=1 x pp=1 x dp=99 = 99 ranks, but the world has {size}"),
    (dict(tp=0), "tp must be a whole number of at least 1, got 0"),
    (dict(pp=-1), "pp must be a whole number of at least 1, got -1"),
    (dict(tp=2.0), "tp must be a whole number of at least 1, got 2.0")])
def test_mismatch_is_a_clear_error_on_every_rank(comm, kw, says):
    size = comm.Get_size()
    if kw.get("tp") == 3 and size % 9 == 0:
        pytest.skip("9 divides this world")
    with pytest.raises(GridError) as err:
        ProcessGrid(**kw)
    assert says.format(size=size) in str(err.value), str(err.value)
    # an agreed error must be raised by every rank alike: count them (MPI's own all-reduce)
    raised = np.ones(1, np.int64)
    everyone = np.empty_like(raised)
    comm.Allreduce(raised, everyone, op=MPI.SUM)
    assert everyone[0] == size


def cp_factorizations(size):
    return [(tp, cp, pp) for tp in range(1, size + 1) for cp in range(2, size + 1) for pp in range(1, size + 1)
            if size % (tp * cp * pp) == 0]


def test_every_factorization_with_context_parallelism(comm):
    """tp fastest, then cp, then pp, then dp; cp_comm and dp_cp_comm hold what cp_group and
    dp_cp_group say (dp_cp: rank dp_rank * cp + cp_rank, where Megatron averages gradients)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    for tp, cp, pp in cp_factorizations(size):
        g = ProcessGrid(tp=tp, cp=cp, pp=pp)
        dp = size // (tp * cp * pp)
        where = f"grid tp={tp} cp={cp} pp={pp} dp={dp}, rank {rank}"
        assert (g.tp, g.cp, g.pp, g.dp) == (tp, cp, pp, dp), where
        assert rank == ((g.dp_rank * pp + g.pp_rank) * cp + g.cp_rank) * tp + g.tp_rank, \
            f"{where}: tp must vary fastest, then cp, then pp"
        assert g.rank_of(g.dp_rank, g.pp_rank, g.tp_rank, g.cp_rank) == rank
        assert g.coords4(rank) == (g.dp_rank, g.pp_rank, g.cp_rank, g.tp_rank)
        for name, sub, want_rank, group in (("tp", g.tp_comm, g.tp_rank, g.tp_group()),
                                            ("cp", g.cp_comm, g.cp_rank, g.cp_group()),
                                            ("pp", g.pp_comm, g.pp_rank, g.pp_group()),
                                            ("dp", g.dp_comm, g.dp_rank, g.dp_group()),
                                            ("dp_cp", g.dp_cp_comm, g.dp_rank * cp + g.cp_rank, g.dp_cp_group())):
            assert sub.Get_rank() == want_rank, f"{where}: my rank in {name}_comm is {sub.Get_rank()}"
            assert members(sub, comm) == group, \
                f"{where}: {name}_comm holds ranks {members(sub, comm)}, expected {group}"
        assert "cp group" in str(g) and len(str(g).splitlines()) == size + 3, str(g)
        g.free()


def test_cp_1_changes_nothing(comm):
    """Without cp, the groups are as before; cp_comm is each rank alone, dp_cp_comm is dp's."""
    for tp, pp in factorizations(comm.Get_size()):
        g = ProcessGrid(tp=tp, pp=pp)
        assert g.cp == 1 and g.cp_rank == 0 and g.cp_comm.Get_size() == 1
        assert members(g.dp_cp_comm, comm) == g.dp_group()
        assert "cp" not in str(g).splitlines()[1] and repr(g) == f"ProcessGrid(tp={tp}, pp={pp}, dp={g.dp})"
        g.free()


@pytest.mark.parametrize("kw,says", [
    (dict(cp=0), "cp must be a whole number of at least 1, got 0"),
    (dict(cp=True), "cp must be a whole number of at least 1, got True"),
    (dict(tp=1, cp=1, dp=99), "tp=1 x pp=1 x dp=99 = 99 ranks, but the world has {size}"),
    (dict(cp=2, dp=99), "tp=1 x cp=2 x pp=1 x dp=99 = 198 ranks, but the world has {size}")])
def test_cp_mismatch_is_a_clear_error_on_every_rank(comm, kw, says):
    test_mismatch_is_a_clear_error_on_every_rank(comm, kw, says)


def test_cp_that_does_not_divide_the_world(comm):
    size = comm.Get_size()
    cp = next(c for c in range(2, size + 2) if size % c)
    with pytest.raises(GridError) as err:
        ProcessGrid(cp=cp)
    assert f"tp=1 x cp={cp} x pp=1 = {cp} ranks per replica does not divide the {size} ranks" in str(err.value)
