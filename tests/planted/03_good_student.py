"""A correct exercise-03 file in a student's style (its own f and g inside the layers,
np.array_split, the loss in three all-reduces). Must PASS."""
import numpy as np

from minidist.comm import all_reduce


def f_forward(comm, x):
    return x


def f_backward(comm, grad):
    return all_reduce(comm, grad, op="sum")


def g_forward(comm, x):
    return all_reduce(comm, x, op="sum")


def g_backward(comm, grad):
    return grad


def split_for_rank(a, axis, rank, t):
    return np.array_split(a, t, axis=axis)[rank]


def column_parallel_forward(comm, x, weight, bias):
    y = f_forward(comm, x) @ weight
    return y if bias is None else y + bias


def column_parallel_backward(comm, x, weight, grad):
    gx = f_backward(comm, grad @ weight.T)
    gw = np.einsum("bsi,bso->io", x, grad)
    return gx, gw, grad.sum(axis=(0, 1))


def row_parallel_forward(comm, x, weight, bias):
    y = g_forward(comm, x @ weight)
    return y if bias is None else y + bias


def row_parallel_backward(comm, x, weight, grad):
    grad = g_backward(comm, grad)
    return grad @ weight.T, np.einsum("bsi,bso->io", x, grad), grad.sum(axis=(0, 1))


def vocab_parallel_cross_entropy_forward(comm, logits, targets, lo, vocab_size):
    n, v = logits.shape
    real = lo + np.arange(v) < vocab_size
    z = np.where(real, logits, -np.inf)
    m = all_reduce(comm, z.max(axis=1), op="max")
    z = z - m[:, None]
    mine = (targets >= lo) & (targets < lo + v)
    picked = np.zeros(n, logits.dtype)
    picked[mine] = z[mine, targets[mine] - lo]
    target = all_reduce(comm, picked, op="sum")
    e = np.exp(z)
    s = all_reduce(comm, e.sum(axis=1), op="sum")
    return np.mean(np.log(s) - target), e / s[:, None]


def vocab_parallel_cross_entropy_backward(probs, targets, lo, grad):
    n, v = probs.shape
    d = probs.copy()
    mine = (targets >= lo) & (targets < lo + v)
    d[mine, targets[mine] - lo] -= 1.0
    return d * grad / n
