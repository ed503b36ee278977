"""Planted bug: the forward records fn's graph, so every activation is kept after all."""
from minidist.recompute import dropout_counters


def checkpoint_forward(fn, inputs):
    counters = dropout_counters(inputs)
    return fn(*inputs), counters
