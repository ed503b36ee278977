"""Exercise 4.3 retried forever: a bare `except` swallows the grader's stop, so the check's
thread never ends and the job can grade nothing after it. In the teacher's form each file
has jobs of its own, so the next student is graded all the same (test_planted.py)."""
import numpy as np

EXPECT = {"4.3": "did not finish within"}
TIMEOUT = 5
DEADLOCK = True
ALONE = True


def exchange(comm, send=None, recv=None):
    while True:
        try:
            got = None
            if send is not None:
                comm.Send(send[0], send[1], send[2])
            if recv is not None:
                shape, dtype, source, tag = recv
                got = np.empty(shape, dtype)
                comm.Recv(got, source, tag)
            return got, None
        except:  # noqa: E722  (the bug: it catches the grader's stop too)
            pass
