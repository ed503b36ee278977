"""The small float64 training run that the ZeRO and FSDP tests share, and its reference.

48 sequences divide by 1, 2, 3, 4 and 8 ranks x 2 micro-batches; n_embd=10 and 2 heads
give parameter counts that 3, 4 and 8 do not divide; the clipping norm 0.05 really clips.
The reference (one process, the whole batch) is trained once per module and kept.
"""
from types import SimpleNamespace

from minidist.data import Dataset, default_corpus
from minidist import equivalence
from minidist.model import GPT, GPTConfig
from minidist.train import TrainConfig

BATCH, ACCUM = 2 * 24, 2


class Setup:
    def __init__(self, n_layer):
        self.cfg = GPTConfig(block_size=9, vocab_size=256, n_layer=n_layer, n_head=2, n_embd=10, dtype="float64")
        self.data = Dataset.from_text(default_corpus()[:20_000], block_size=9, seed=5)
        self.args = SimpleNamespace(steps=3, batch_size=BATCH, seed=7)
        self.tc = TrainConfig(batch_size=BATCH, max_iters=3, learning_rate=3e-3, warmup_iters=1, grad_clip=0.05)
        self._ref = None

    def fresh(self):
        """The model every run starts from, and its AdamW with the reference's decay groups."""
        model = GPT(self.cfg, seed=11)
        tc = self.tc
        return model, model.configure_optimizers(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2))

    def reference(self):
        """(losses, state) of one process over the whole batch, trained on first use."""
        if self._ref is None:
            m, o = self.fresh()
            losses, state, _ = equivalence.train_and_collect(m, o, self.data, self.args, self.tc, micro=ACCUM)
            self._ref = (losses, state)
        return self._ref
