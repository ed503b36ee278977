"""gather_params that asserts the unit splits evenly over the ranks: the student's own
assert fails, and the verdict says it is theirs, not the grader's."""
from minidist.comm import ring_all_gather

EXPECT = {"6.1": "your code's assert failed: the unit must split evenly (at line 10 of 06_gather_asserts_even.py"}
RANKS = 3


def gather_params(comm, group):
    assert group.n % comm.Get_size() == 0, "the unit must split evenly"
    full = ring_all_gather(comm, group.shard)
    group.point(full)
    return full
