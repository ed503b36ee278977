"""Exercise 08: activation recomputation, the two halves of a checkpoint.

minidist.recompute.checkpoint(fn, *inputs) is one node of the graph in place of fn's whole graph.
Its forward runs fn keeping nothing inside it; its backward runs fn again, recording,
and backpropagates through the graph it just rebuilt. The package's versions live in
minidist/recompute.py under the same names; its Checkpoint Function calls them (the
node itself saves the Tensor inputs' arrays, and hands you Tensors holding them again
in backward). Replace each `raise` with your code, then grade your file:

    python -m minidist.grade lessons/exercises/08_activation_recompute.py

The grader checks, on a chain of three GPT blocks in float64 with dropout, whose
DropoutRNG's counter does not start at 0 (the layers before drew masks too): that your
forward's output equals each block's and keeps nothing for backward (the meter,
minidist.tensor.MEMORY, reads the same before and after), returns the counters as they
were before fn ran, and leaves the counter where fn left it (the next block draws after
it); that your backward returns a gradient for the input that requires one, that its
rerun draws the forward's masks, and that the gradients (of the input and of every
parameter) equal the blocks' without recomputation exactly; and that every DropoutRNG
counter is back where it was when your backward returns. Then lesson 08 runs with your
function in the package's place, every policy, in float64 and float32.
"""
from minidist.recompute import dropout_counters  # noqa: F401  (given: [(rng, calls)] for the inputs' DropoutRNGs)
from minidist.tensor import Tensor, no_grad  # noqa: F401  (you will want them)


def checkpoint_forward(fn, inputs):
    """Run fn(*inputs) without recording a graph. Returns (output Tensor, counters).

    inputs: a list of Tensors and other values (a DropoutRNG, ...). counters: the
    dropout counters of the inputs (dropout_counters(inputs)), taken BEFORE fn runs:
    fn's dropout layers advance them, and the backward must replay the same masks.
    Under no_grad() the ops keep nothing for backward (the grader reads the meter's peak
    while fn runs: recording a graph and dropping it afterwards FAILS).
    """
    raise NotImplementedError("exercise 8.1: checkpoint_forward")


def checkpoint_backward(fn, inputs, counters, grad):
    """Rebuild fn's graph and backpropagate grad through it. Returns one gradient per input.

    inputs: Tensors holding the forward's input arrays (no graph behind them) and the
    other values as they were; counters: what checkpoint_forward returned; grad: the
    gradient of fn's output (any shape: a pipeline stage passes a non-scalar one).
        1. note each rng's counter now, then set rng.calls back to the forward's start;
        2. make fresh leaves, Tensor(x.data, requires_grad=x.requires_grad), for the Tensors;
        3. out = fn(*leaves), recording (gradients on); put the counters back as noted;
        4. out.backward(grad): the parameters fn uses get their .grad here, added to what
           they hold (earlier micro-batches' gradients: never clear .grad here);
        5. return [leaf.grad for a Tensor input, None for any other input].
    """
    raise NotImplementedError("exercise 8.2: checkpoint_backward")
