"""Exercise 03: the pieces of Megatron-LM's tensor parallelism, by hand.

Eleven functions, each mirroring one of minidist/parallel/tensor_parallel.py by name and
signature: the package's layers call those very functions. They work on NumPy arrays;
`comm` is the tensor-parallel group (t ranks). Read lessons/03_tensor_parallel.md and
docs/reference.md#tensor-parallelism first.

Communication: the only call you need is minidist's own all-reduce,

    all_reduce(comm, x, op="sum")      # or op="max"; returns a new array, the same on every rank

(the ring of lesson 01, on point-to-point messages). The communicator the grader hands
you refuses MPI's collectives (comm.Allreduce), counts every byte each rank sends, and
holds each function to exactly the all-reduces the layer needs: a direction that moves
nothing must send nothing, and the loss sends three all-reduces of N numbers, never the
N x V logits. Return new arrays: never write into an input (`x -= m` changes the caller's
array). Replace each `raise` with your code, then grade at 3 ranks and at 4 (below 3 the
multi-rank exercises fail and say so):

    mpirun -n 3 python -m minidist.grade lessons/exercises/03_tensor_parallel.py
    mpirun -n 4 python -m minidist.grade lessons/exercises/03_tensor_parallel.py

The grader gives your function only this rank's part of a problem built from a seed, and
only after it returned computes the single-process answer with NumPy. It tries every
function in float64 and in float32: keep the input's dtype (np.zeros(n) is float64; use
np.zeros(n, x.dtype)), within a tolerance it names. It calls each function several times,
with other inputs of the same shape: return a new array each call (a result returned
earlier must keep its values). Column and row counts do not divide by the number of
ranks, and the padding of the vocabulary may fall on several ranks. Then, for each
function that passed and that the package's layers call by name, it puts yours in the
package's place and runs lesson 03 on it, in float64 and float32.
The package's answers are in minidist/parallel/tensor_parallel.py under the same names.
"""
import numpy as np  # noqa: F401  (you will want it)

from minidist.comm import all_reduce  # noqa: F401  (the ring all-reduce: use it, not comm.Allreduce)

# ----------------------------------------------------------------------------- f and g
# A Linear computes Y = X A + b, A of shape (in, out). Megatron's f enters a tensor-parallel
# region, g leaves it; each is the other's conjugate (docs/reference.md#tensor-parallelism).


def f_forward(comm, x):
    """f going forward. Every rank already holds the whole input X, and a column-parallel
    layer needs exactly that. Return x's values. Allowed communication: none."""
    raise NotImplementedError("exercise 3.1: f_forward")


def f_backward(comm, grad):
    """f going back. grad is this rank's part of dX: (dY_r) A_r^T, from its own columns.
    dX = dY A^T is the sum of the t parts. Return the sum, the same on every rank.
    Allowed communication: one all_reduce(comm, grad, op="sum")."""
    raise NotImplementedError("exercise 3.2: f_backward")


def g_forward(comm, x):
    """g going forward. x is this rank's partial sum X_r A_r of a row-parallel layer;
    Y = X A is the sum over the t ranks. Return the sum, the same on every rank.
    Allowed communication: one all_reduce of x."""
    raise NotImplementedError("exercise 3.3: g_forward")


def g_backward(comm, grad):
    """g going back. Y is the plain sum of the parts, so the gradient of each part is dY
    itself, and every rank already holds the whole dY. Return grad's values.
    Allowed communication: none."""
    raise NotImplementedError("exercise 3.4: g_backward")

# ----------------------------------------------------------------------------- the split


def split_for_rank(a, axis, rank, t):
    """Rank `rank`'s piece of the whole array `a` cut in t along `axis`: chunk `rank` of
    numpy.array_split(a, t, axis) (the first len % t pieces one longer).

    The package cuts a column-parallel weight A (in, out) along axis 1 (its columns) and
    its bias along axis 0; a row-parallel weight along axis 0 (its rows), with its bias
    whole on every rank. Leave `a` unchanged. No communicator: every rank computes its
    own piece from the same whole array.
    """
    raise NotImplementedError("exercise 3.5: split_for_rank")

# ----------------------------------------------------------------------------- column- and row-parallel
# x has shape (b, s, in): a batch of b sequences of s tokens. Weights are (in, out).


def column_parallel_forward(comm, x, weight, bias):
    """Y_r = f(X) A_r + b_r: this rank's columns of Y = X A + b.

    x (b, s, in) whole; weight (in, out_r) = A's columns of this rank; bias (out_r,) or None.
    Return (b, s, out_r). Call your f_forward on x first. Allowed communication: none.
    """
    raise NotImplementedError("exercise 3.6: column_parallel_forward")


def column_parallel_backward(comm, x, weight, grad):
    """Return (grad_x, grad_weight, grad_bias) from grad = dY_r (b, s, out_r), this rank's
    columns of dY.

    grad_weight = X^T dY_r (in, out_r) and grad_bias = dY_r summed over b and s (out_r,)
    are this rank's columns: local. grad_x = dY A^T is the sum over ranks of dY_r A_r^T:
    compute your part, then f_backward. Allowed communication: one all-reduce of grad_x.
    """
    raise NotImplementedError("exercise 3.7: column_parallel_backward")


def row_parallel_forward(comm, x, weight, bias):
    """Y = g(X_r A_r) + b, whole on every rank.

    x (b, s, in_r): this rank's columns of X (what a column-parallel layer produced);
    weight (in_r, out): A's rows of this rank; bias (out,), the same on every rank, or
    None. Add the bias once, after the sum: added before, it would count t times.
    Allowed communication: one all-reduce of (b, s, out).
    """
    raise NotImplementedError("exercise 3.8: row_parallel_forward")


def row_parallel_backward(comm, x, weight, grad):
    """Return (grad_x, grad_weight, grad_bias) from grad = dY (b, s, out), whole and the
    same on every rank.

    g going back is the identity, so all is local: grad_x = dY A_r^T (b, s, in_r), this
    rank's columns of dX; grad_weight = X_r^T dY (in_r, out), its rows of dA; grad_bias =
    dY summed over b and s (out,), whole. Allowed communication: none.
    """
    raise NotImplementedError("exercise 3.9: row_parallel_backward")

# ----------------------------------------------------------------------------- the vocabulary-parallel loss


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    """Return (loss, probs): the mean cross-entropy over N tokens, with the (N, V) logits
    split by vocabulary columns, never gathered.

    logits (N, V_r): this rank's columns, ids lo .. lo + V_r - 1 (the vocabulary is padded
    to a multiple of t: ids >= vocab_size are padding and count as logit -inf, probability
    0). targets (N,) int ids, whole on every rank. Three all-reduces of N numbers:
      m      = all-reduce MAX of each row's local max            (shift by the GLOBAL max:
                                                                 exp(1000) overflows)
      target = all-reduce SUM of (logit[target] - m), 0 on ranks that do not own the target
      s      = all-reduce SUM of each row's local sum of exp(logit - m)
      loss   = mean(log s - target)
    probs (N, V_r) = exp(logit - m) / s, this rank's columns of the softmax (0 for padding).
    The loss is one number: a NumPy scalar in the logits' dtype (np.mean of them), or a
    Python float (float(np.mean(...))); the caller converts it to the logits' dtype. A
    float64 NumPy loss from float32 logits says some arithmetic ran in float64 (np.zeros(n)
    without a dtype), and that also doubles the bytes all-reduced: the grader FAILs it.
    Allowed communication: exactly those three all-reduces (b*s numbers each), never the
    logits. Leave logits and targets unchanged.
    """
    raise NotImplementedError("exercise 3.10: vocab_parallel_cross_entropy_forward")


def vocab_parallel_cross_entropy_backward(probs, targets, lo, grad):
    """Return d(grad * loss)/d(this rank's logits) = grad * (probs - one_hot(targets)) / N,
    (N, V_r): the one-hot has its 1 in this rank's columns only for the targets it owns
    (lo <= target < lo + V_r). All of it local: no communicator. Leave the inputs unchanged.
    """
    raise NotImplementedError("exercise 3.11: vocab_parallel_cross_entropy_backward")
