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
the learning rate's cosine decay runs over tokens, not steps: counted in steps, the
decay would end before the tokens did (Li et al. 2022, appendix A.2). The learning-rate
WARM-UP stays counted in steps, as DeepSpeed's curriculum tutorial says: "For LR warmup
we don't change it to token-based, because doing so for curriculum learning means
slowing down the LR warmup, which is both unnecessary and harmful" (DeepSpeed
docs/_tutorials/curriculum-learning.md, "LR warmup adjustment"). Megatron-DeepSpeed's
token-based scheduler (megatron/learning_rates.py, AnnealingLR) does the same: warm-up
over `warmup_steps` steps, the tokens seen by then recorded, and the cosine running from
there to the decay's end in tokens. So does this class: the plain run and the curriculum
run warm up over the same number of steps (the curriculum's hold fewer tokens), and
each decays over the tokens left after its own warm-up.
"""
from minidist.train import cosine_decay, linear_warmup


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


def lr_at(step, tokens, warmup_steps, warmup_end_tokens, total_tokens, peak, floor):
    """The learning rate of the step after `step` steps and `tokens` tokens: a linear
    warm-up over the first `warmup_steps` STEPS, then a cosine from peak to floor over the
    tokens from `warmup_end_tokens` (those seen when the warm-up ended) to `total_tokens`.
    The same two formulas as minidist/train.py's get_lr, the decay measured in tokens."""
    if step < warmup_steps:
        return linear_warmup(step, warmup_steps, peak)
    return cosine_decay(tokens - warmup_end_tokens, total_tokens - warmup_end_tokens, peak, floor)


class Curriculum:
    """Where a run is: steps taken, tokens seen; what the next step trains on.

    plain=True is the run without a curriculum, counted the same way (full length from
    the first step), so both runs share one loop and one learning-rate rule (for the
    plain run, tokens are steps x a constant: the rule is train.get_lr's, step for step).
    warmup_steps: the learning-rate warm-up, in steps for both runs.
    """

    def __init__(self, block_size, batch_size, total_tokens, ramp_steps, start=8, plain=False,
                 peak_lr=1e-3, min_lr=1e-4, warmup_steps=0):
        self.block_size, self.batch_size, self.total_tokens = block_size, batch_size, total_tokens
        self.ramp_steps, self.start, self.plain = ramp_steps, min(start, block_size), plain
        self.peak_lr, self.min_lr, self.warmup_steps = peak_lr, min_lr, warmup_steps
        self.step, self.tokens, self.warmup_end_tokens = 0, 0, 0

    def seqlen(self):
        if self.plain:
            return self.block_size
        return seqlen_at(self.step, self.start, self.block_size, self.ramp_steps)

    def lr(self):
        return lr_at(self.step, self.tokens, self.warmup_steps, self.warmup_end_tokens,
                     self.total_tokens, self.peak_lr, self.min_lr)

    def done(self):
        return self.tokens >= self.total_tokens

    def advance(self, seqlen):
        """One step taken on `seqlen`-token sequences: count its tokens."""
        self.step += 1
        self.tokens += self.batch_size * seqlen
        if self.step <= self.warmup_steps:
            self.warmup_end_tokens = self.tokens      # the decay starts from the warm-up's end

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens, "warmup_end_tokens": self.warmup_end_tokens}

    def load_state_dict(self, d):
        self.step, self.tokens = int(d["step"]), int(d["tokens"])
        self.warmup_end_tokens = int(d.get("warmup_end_tokens", 0))
