"""update_scale that halves on an inf and counts the skipped step as a good one."""
import numpy as np

EXPECT = {'10.2': 'an inf restarts the count'}
RANKS = 1


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        scale = scale * backoff_factor
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps
