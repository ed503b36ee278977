"""What train_step (minidist/train.py) asks of a parallel strategy, in one place.

A strategy changes what happens around backward and before the optimizer step. Each hook
below has the single-process behaviour as its default, so a strategy overrides only what
it changes and train_step calls every hook unconditionally: `Strategy()` is one process.

    owns_schedule       False: train_step runs the micro-batches itself, each backward
                        inside backward_context(last). True: forward_backward(model,
                        batches, scale) runs every forward and backward of the step in the
                        strategy's own order (a pipeline's schedule) and returns the mean loss
    sync()              after the last backward, before clipping (data parallelism's
                        all-reduce of the gradients ends here)
    named_grads(model)  [(name, tensor holding its gradient)]: the model's parameters, or
                        what the strategy keeps the gradients in (ZeRO's partitions)
    named_weights(model) the same for the weights (what a run's result is compared on)
    grad_norm_sq(held)  the squared norm of the WHOLE model's gradient, when this rank holds
                        only part of it (a shard, a stage, a partition); None: the local
                        gradients are the whole (every replica holds the same after sync)
    expert_params       the parameters spread over an expert-parallel group (none here)
    checkpoint_*        what this rank saves and loads of a checkpoint: its pieces of the
                        global tensors, their names and shapes, the optimizer state they
                        go to, what to do after a load, the layout's name
                        (minidist/checkpoint/layouts.py calls them)

This contract is this project's own. Megatron-LM and DeepSpeed reach the same places
through their own objects: Megatron-LM's get_forward_backward_func
(megatron/core/pipeline_parallel/schedules.py) picks the function that runs a step's
micro-batches, with or without a pipeline; DeepSpeed's DeepSpeedEngine.backward and .step
(deepspeed/runtime/engine.py) hide ZeRO's reduce and partitioned update; PyTorch's
DistributedDataParallel.no_sync() is a backward that only accumulates.
"""
import contextlib

from minidist.parallel import pieces


class Strategy:
    """What train_step asks of a parallel strategy: every hook, a no-op by default."""
    owns_schedule = False                 # True: forward_backward runs the micro-batches
    expert_params = ()                    # parameters spread over an expert-parallel group

    def forward_backward(self, model, batches, scale):
        """Run every micro-batch's forward and backward (each loss times `scale`) in this
        strategy's order; return the mean loss. Only where owns_schedule is True."""
        raise NotImplementedError(f"{type(self).__name__} does not run its own schedule")

    def backward_context(self, last):
        """A context each backward runs inside; `last`: the step's last micro-batch."""
        return contextlib.nullcontext()

    def no_sync(self):
        """A backward that only accumulates (PyTorch DDP's name for it)."""
        return self.backward_context(last=False)

    def sync(self):
        """After the last backward, before clipping."""

    def named_grads(self, model):
        """[(name, tensor whose .grad is the gradient)] that clipping, raw_grads and the
        optimizer see."""
        return model.named_parameters()

    def named_weights(self, model):
        """[(name, tensor)] of the weights a run is compared on (ZeRO: my partition)."""
        return model.named_parameters()

    def grad_norm_sq(self, held):
        """The whole model's squared gradient norm, or None: the local one is the whole."""
        return None

    # -- what a checkpoint saves and loads of this rank (minidist/checkpoint/layouts.py);
    # the defaults read the model (minidist/parallel/pieces.py): whole tensors,
    # tensor-parallel shards, a pipeline stage's layers, expert-parallel experts.
    # ZeRO and FSDP report their partitions.
    def checkpoint_pieces(self, model, opt):
        """(pieces, states): every region of every global tensor this rank holds, as
        pieces.Held, and the AdamW state of each parameter they came from."""
        return pieces.model_pieces(model, opt)

    def checkpoint_tensors(self, model):
        """[(name, global shape, dtype)] of every parameter this rank holds part of."""
        return pieces.model_tensors(model)

    def checkpoint_optimizer(self, opt):
        """The optimizer whose state a checkpoint fills."""
        return opt

    def checkpoint_params(self, model, opt):
        """The tensors that optimizer keeps state for (fp32 masters under mixed precision)."""
        return pieces.model_params(model, opt)

    def checkpoint_loaded(self):
        """After a load has filled this rank's pieces (ZeRO 1, 2: all-gather the weights)."""

    def checkpoint_layout(self, model):
        """The layout's name in the index ("" here: the model's cut, or data parallel)."""
        return ""
