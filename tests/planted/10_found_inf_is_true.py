"""update_scale that tests `found_inf is True`: right for a Python bool, but a numpy.bool_
or a 1 never backs the scale off (every fp16 step then overflows and is skipped)."""

EXPECT = {"10.2": "`found_inf is True` reads it wrong"}
RANKS = 1


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf is True:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps
