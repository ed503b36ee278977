"""update_scale that grows when good_steps reaches growth_interval - 1 (off by one)."""
import numpy as np

EXPECT = {'10.2': 'grown one step early'}
RANKS = 1


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    if good_steps + 1 >= growth_interval - 1:
        return scale * growth_factor, 0
    return scale, good_steps + 1
