"""checkpoint_forward that rewinds the DropoutRNG's counter after fn ran ("so that the
backward finds it where it started"): the next layer then draws the masks this one drew,
and under full recomputation every block gets the first block's masks."""
from minidist.recompute import dropout_counters
from minidist.tensor import no_grad

EXPECT = {"8.1": "after your checkpoint_forward of block 0 the DropoutRNG's counter is 5; fn drew 3 masks from 5"}
RANKS = 1


def checkpoint_forward(fn, inputs):
    counters = dropout_counters(inputs)
    with no_grad():
        out = fn(*inputs)
    for rng, start in counters:
        rng.calls = start
    return out, counters
