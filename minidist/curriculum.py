"""Curriculum learning: sequence-length warm-up, as DeepSpeed's curriculum does it.

    mpirun -n 4 python -m minidist.lessons.10_precision_and_compression --curriculum

Li et al. 2022 ("The Stability-Efficiency Dilemma", the paper behind DeepSpeed's
curriculum learning) train the first steps on short sequences: the batch's sequences
are cut to a length that grows linearly from a short start to the full block size,
rounded down to a multiple of 8 (DeepSpeed's `fixed_linear` schedule with
`difficulty_step` 8, which keeps the matrices a multiple of 8 for tensor cores).
Short sequences are cheap and, early on, give steadier gradients.

A step then holds fewer tokens, so a curriculum run counts its progress in TOKENS: it
trains until it has seen the same number of tokens as the plain run (more steps), and
the learning rate warms up and decays over tokens, not steps (DeepSpeed pairs its
curriculum with token-based decay for this reason: counted in steps, the decay would
end before the tokens did).
"""
import math


def seqlen_at(step, start, end, ramp_steps, multiple=8):
    """The sequence length of `step`: linear from `start` to `end` over `ramp_steps`
    steps, rounded down to a multiple of `multiple` (never below `start`), then `end`."""
    if not 0 < start <= end:
        raise ValueError(f"the curriculum needs 0 < start <= end, got start {start}, end {end}")
    if ramp_steps <= 0 or step >= ramp_steps:
        return end
    length = start + (end - start) * step / ramp_steps
    length = int(length) - int(length) % multiple
    return min(end, max(start, length))


def lr_at_tokens(tokens, total_tokens, peak, floor, warmup_tokens):
    """nanoGPT's schedule (linear warm-up, cosine decay to `floor`) counted in tokens:
    the learning rate after `tokens` tokens of a run of `total_tokens`."""
    if tokens < warmup_tokens:
        return peak * (tokens + 1) / (warmup_tokens + 1)
    if tokens >= total_tokens:
        return floor
    ratio = (tokens - warmup_tokens) / max(1, total_tokens - warmup_tokens)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


class Curriculum:
    """Where a run is: steps taken, tokens seen; what the next step trains on.

    plain=True is the run without a curriculum, counted the same way (full length from
    the first step), so both runs share one loop and one learning-rate rule.
    """

    def __init__(self, block_size, batch_size, total_tokens, ramp_steps, start=8, plain=False,
                 peak_lr=1e-3, min_lr=1e-4, warmup_tokens=0):
        self.block_size, self.batch_size, self.total_tokens = block_size, batch_size, total_tokens
        self.ramp_steps, self.start, self.plain = ramp_steps, min(start, block_size), plain
        self.peak_lr, self.min_lr, self.warmup_tokens = peak_lr, min_lr, warmup_tokens
        self.step, self.tokens = 0, 0

    def seqlen(self):
        if self.plain:
            return self.block_size
        return seqlen_at(self.step, self.start, self.block_size, self.ramp_steps)

    def lr(self):
        return lr_at_tokens(self.tokens, self.total_tokens, self.peak_lr, self.min_lr, self.warmup_tokens)

    def done(self):
        return self.tokens >= self.total_tokens

    def advance(self, seqlen):
        """One step taken on `seqlen`-token sequences: count its tokens."""
        self.step += 1
        self.tokens += self.batch_size * seqlen

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, d):
        self.step, self.tokens = int(d["step"]), int(d["tokens"])
