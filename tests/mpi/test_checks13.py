"""Exercise 13.3's check (ring_pass_start) passes the package's own answer and catches wrong
ones, on every rank, in words, at once: the check agrees each finding over the ranks, so
every rank raises the same sentence and none is left waiting for a message that will never
come (no grader here to stop it).

Called directly (no grader, no rule about 3 ranks). The grader's view, with planted files
(blocking sends, a wait inside, collectives, pickling): tests/test_planted.py.
"""
import re

import pytest

from minidist.grader.checks import ex13_context_parallel as ex13
from minidist.parallel import context_parallel

pytestmark = pytest.mark.mpi


def test_package_answer_passes(comm):
    ex13.check_ring_pass_start(context_parallel.ring_pass_start)


def _ring(send_to, recv_from, tag=None, order=None):
    """A ring_pass_start with its neighbours, tag and order of the requests made up."""
    def ring_pass_start(c, send_arrays, recv_arrays, t):
        n, r = c.Get_size(), c.Get_rank()
        recvs = [c.Irecv(b, recv_from(r, n), t if tag is None else tag) for b in recv_arrays]
        sends = [c.Isend(a, send_to(r, n), t if tag is None else tag) for a in send_arrays]
        if order == "sends first":
            return sends + recvs
        return [q for pair in zip(recvs, sends) for q in pair]
    return ring_pass_start


RIGHT, LEFT = (lambda r, n: (r + 1) % n), (lambda r, n: (r - 1) % n)


@pytest.mark.parametrize("fn, words, least", [
    (_ring(RIGHT, LEFT), None, 1),
    (_ring(LEFT, RIGHT), "the ring sends to the right neighbour, (rank + 1) % n", 3),
    (_ring(lambda r, n: (r - 1 if r % 2 else r + 1) % n, lambda r, n: (r + 1 if r % 2 else r - 1) % n),
     "rank 1, one float64 array (B, nh, T, hs) (tag 7): sent to rank 0", 3),
    (_ring(RIGHT, LEFT, tag=0), "sent with tag 0; use the tag given, 7", 1),
    (_ring(RIGHT, LEFT, order="sends first"), "return them as [recv[0], send[0], recv[1], send[1], ...]", 1),
])
def test_a_wrong_ring_step_fails_alike_on_every_rank(comm, fn, words, least):
    """Each finding is raised on every rank, the same sentence (naming the rank that found it);
    the check then runs again with the package's answer: the misrouted messages were taken back."""
    if comm.Get_size() < least:
        pytest.skip(f"below {least} ranks this mistake goes the same way as the right ring")
    if words is None:
        ex13.check_ring_pass_start(fn)
        return
    with pytest.raises(AssertionError, match=re.escape(words)):
        ex13.check_ring_pass_start(fn)
    ex13.check_ring_pass_start(context_parallel.ring_pass_start)
