"""Exercise 04's checks pass the package's own answers and catch wrong ones, on every rank."""
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from minidist.grader.checks import ex04_pipeline_parallel as ex04
from minidist.parallel import pipeline_parallel

pytestmark = pytest.mark.mpi
EXCHANGE = next(e for e in ex04.EXERCISES if e.name == "exchange")


@pytest.mark.parametrize("exercise", ex04.EXERCISES, ids=lambda e: e.name)
def test_package_answer_passes(comm, exercise):
    exercise.check(exercise.reference)


def test_a_received_array_from_the_wrong_rank_fails(comm):
    if comm.Get_size() < 2:
        pytest.skip("needs a partner")

    def own(c, send=None, recv=None):
        got, req = pipeline_parallel.exchange(c, send, recv)
        in_the_ring = recv is not None and recv[3] // 100 == 5       # call 5, the float32 ring: every rank
        return (np.zeros_like(got) if in_the_ring else got), req
    with pytest.raises(AssertionError, match="not the \\(7, 67, 71\\) array rank"):
        ex04.check_exchange(own)


def test_gpipe_in_reverse_backward_order_passes_but_a_missing_backward_fails(comm):
    def gpipe_rev(p, m):
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))] for _ in range(p)]
    ex04.check_gpipe(gpipe_rev)

    def short(p, m):
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m - 1)] for _ in range(p)]
    with pytest.raises(AssertionError, match="never runs B0"):
        ex04.check_gpipe(short)


# ----------------------------------------------------------------------------- wrong exchanges, graded
# These fail on some ranks only (the others wait for them), so the grader's referee agrees
# the verdict, as it does for a student's file.

def _isend_wait_recv(comm, send=None, recv=None):
    got = req = None
    if send is not None:
        req = comm.Isend(send[0], send[1], send[2])
        req.Wait()
    if recv is not None:
        got = np.empty(recv[0], recv[1])
        comm.Recv(got, recv[2], recv[3])
    return got, req


def _always_forward(comm, send=None, recv=None):
    r, n = comm.Get_rank(), comm.Get_size()
    return pipeline_parallel.exchange(comm, send and (send[0], (r + 1) % n, send[2]),
                                      recv and (recv[0], recv[1], (r - 1) % n, recv[3]))


_BUFFERS = {}


def _reused_buffer(comm, send=None, recv=None):
    got, req = pipeline_parallel.exchange(comm, send, recv)
    if got is None:
        return got, req
    buf = _BUFFERS.setdefault((comm.Get_rank(), got.shape, got.dtype.str), np.empty_like(got))
    buf[...] = got
    return buf, req


def _returns_before_its_receive(comm, send=None, recv=None):
    got = None
    if recv is not None:
        got = np.empty(recv[0], recv[1])
        comm.Irecv(got, recv[2], recv[3])
    return got, (comm.Isend(*send) if send is not None else None)


def graded(exercise, fn):
    """(verdict, message) of the grader's unit check of fn, the same on every rank."""
    from minidist.grader.command import Grader
    g = Grader(timeout=30, out=lambda *_: None, plugins=False)
    try:
        return g.one(exercise, SimpleNamespace(**{exercise.name: fn}), None)
    finally:
        g.ctl.Free()


@pytest.mark.parametrize("fn, words", [
    (_isend_wait_recv, "waited for its Isend to rank"),
    (_always_forward, "activations go forward to the next stage, gradients back to the previous one"),
    (_reused_buffer, "receive into a new array on every call"),
    (_returns_before_its_receive, "returned before its receive from rank"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_wrong_exchanges_fail_in_words(comm, fn, words):
    if comm.Get_size() < EXCHANGE.min_ranks:
        pytest.skip("graded from 3 ranks")
    _BUFFERS.clear()
    verdict, message = graded(EXCHANGE, fn)
    assert verdict == "FAIL" and words in message and "did not finish" not in message, message


def test_no_frame_holds_the_received_array_while_exchange_runs(comm):
    """While the student's exchange runs, the check's frames hold nothing equal to what it
    will receive: the expected values are made after it returned."""
    found = []

    def peek(c, send=None, recv=None):
        got, req = pipeline_parallel.exchange(c, send, recv)
        frame = sys._getframe(1)
        while got is not None and frame is not None:
            found.extend(f"{frame.f_code.co_name}: {name}" for name, value in frame.f_locals.items()
                         if isinstance(value, np.ndarray) and value is not got and value.shape == got.shape
                         and np.array_equal(value, got)
                         and not (send is not None and np.array_equal(value, send[0])))   # my own: no news
            frame = frame.f_back
        return got, req
    ex04.check_exchange(peek)
    assert not found, found


def test_the_send_request_is_a_real_request(comm):
    """The Isend the check hands out is an mpi4py Request: Waitall and Test take it."""
    def waitall(c, send=None, recv=None):
        got, reqs = None, []
        if recv is not None:
            got = np.empty(recv[0], recv[1])
            reqs.append(c.Irecv(got, recv[2], recv[3]))
        sreq = c.Isend(*send) if send is not None else None
        MPI.Request.Waitall(reqs)
        return got, sreq
    ex04.check_exchange(waitall)
