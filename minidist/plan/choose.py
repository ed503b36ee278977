"""Choosing a layout under a memory cap: the fastest of the layouts that fit.

    python -m minidist.lessons.12_plan          # the lesson that uses it

A planner estimates many layouts (minidist.plan.search); a team then has a budget of
memory per GPU, often below the datasheet's (room for the framework, fragmentation, the
communication library's buffers). The rule here is this project's own statement of what
every planner does: among the estimates whose memory on the most loaded GPU is at most
the cap, take the one with the shortest step time; between equal step times, the one
listed first; when none fits, say so (None) rather than return the least bad.
"""


def choose(estimates, cap_bytes):
    """The fastest estimate that fits under `cap_bytes`, or None when none fits.

    estimates: a list of objects with `step_time_s` (seconds per step) and
    `memory_bytes_per_gpu` (bytes on the most loaded GPU), e.g. minidist.plan.cost's
    Estimates. An estimate fits when its memory is at most the cap (equal fits). Ties in
    step time go to the one earlier in the list. The list is left as it was.
    """
    best = None
    for e in estimates:
        if e.memory_bytes_per_gpu <= cap_bytes and (best is None or e.step_time_s < best.step_time_s):
            best = e
    return best
