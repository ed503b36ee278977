"""PowerSGD (Vogels et al. 2019): each gradient matrix sent as two thin matrices.

A gradient matrix M (n x m) is approximated by P Q^T of rank r: P = M Q, all-reduced,
orthogonalized; Q = M^T P, all-reduced; one power iteration per step, with Q reused from
the previous step (a warm start that makes one iteration enough). Every rank's M includes
its error feedback, and its new error is M minus the averaged approximation (PyTorch's
powerSGD hook's rule; the ranks' mean error is the same as with each rank's own P P^T M
subtracted, so error feedback's sum rule holds either way). The P's of all matrices travel
in one all-reduce, the Q's in another; vectors (biases, layer-norm weights) are small and
go uncompressed, in one more all-reduce, as the paper and PyTorch's hook do.
Bytes: plan.traffic.powersgd_sent.

One addition of ours: when a step's summed M has rank below r, Gram-Schmidt zeroes the
dependent columns of P, hence of Q, and the warm start would keep them zero for ever;
such a column of Q is drawn again (from `seed`, the same on every rank).

orthogonalize and powersgd_step are exercises (10.5 powersgd_step). LowRank, the
exchange CompressedDataParallel("powersgd") uses, batches every matrix into one
all-reduce and so does its own power iteration rather than call powersgd_step per matrix.

On a device, M, P, Q and the errors live there and the products run there; what crosses
is the two (three) all-reduces' buffers, staged by the comm layer, and once per step the
few bytes that say which columns of Q died. The random Q's are drawn on the host (NumPy's
generator: CuPy's draws other numbers) and copied over, at the start and when a column
is drawn again. Gram-Schmidt has no branch on a device number: a column it zeroes is
chosen by xp.where, not by an `if` that would read the norm on the host.
"""
import numpy as np

from minidist.backend import on_device, to_device, to_numpy, xp
from minidist.comm import ring_all_reduce
from minidist.parallel.compressors import ns
from minidist.plan.traffic import powersgd_sent


def orthogonalize(P):
    """Orthonormal columns spanning P's, by Gram-Schmidt, in a copy (as PowerSGD does).

    Each column loses its components along the columns before it, twice ("twice is
    enough": a second pass removes what the first one's rounding left), then is scaled
    to length 1. A column that is (numerically) zero after that, because P is rank-
    deficient, is set to zero instead of divided by ~0: the product P @ P.T stays the
    projection onto P's column space.
    """
    m = ns(P)
    out = m.array(P, copy=True)
    eps = np.finfo(out.dtype).eps
    for i in range(out.shape[1]):
        col, before = out[:, i], out[:, :i]
        start = m.linalg.norm(col)
        for _ in range(2):
            col -= before @ (before.T @ col)
        norm = m.linalg.norm(col)
        dead = norm <= 10 * out.shape[0] * eps * start
        col[...] = m.where(dead, 0, col / m.where(dead, 1, norm))
    return out


def powersgd_step(comm, M, Q):
    """One PowerSGD power iteration on one matrix: (approx, Q_new).

    M: this rank's gradient matrix (n x m, error feedback already added); Q: m x r, the
    same on every rank (the previous step's Q_new). P = M Q summed over ranks,
    orthogonalized; Q_new = M^T P summed over ranks; approx = P Q_new^T / N, the rank-r
    approximation of the average of M. Two ring all-reduces of r(n + m) numbers in all.
    New arrays; M and Q are left as they are. (Exercise 10.5.)
    """
    size = comm.Get_size()
    P = orthogonalize(ring_all_reduce(comm, M @ Q))
    Q_new = ring_all_reduce(comm, M.T @ P)
    return P @ Q_new.T / size, Q_new


def _all_reduce_parts(comm, parts):
    """Sum {key: array} over ranks as one flat ring all-reduce; the same keys and shapes back."""
    flat = ring_all_reduce(comm, ns(next(iter(parts.values()))).concatenate(
        [a.reshape(-1) for a in parts.values()]))
    out, at = {}, 0
    for key, a in parts.items():
        out[key] = flat[at:at + a.size].reshape(a.shape)
        at += a.size
    return out


class LowRank:
    """PowerSGD's state and step for a list of parameters: matrices (ndim >= 2, seen as
    shape[0] x rest) get rank min(rank, n, m), a Q drawn from `seed` (the same on every
    rank) and a zero error; vectors go uncompressed."""

    def __init__(self, params, names, dtype, rank, seed):
        shapes = [(p.data.shape[0], p.data.size // p.data.shape[0]) for p in params]
        self.names, self.seed, self.dtype = names, seed, dtype
        self.sizes = [int(p.data.size) for p in params]
        self.matrices = [i for i, p in enumerate(params) if p.data.ndim >= 2]
        self.vectors = [i for i, p in enumerate(params) if p.data.ndim < 2]
        if self.matrices:
            largest = max(self.matrices, key=lambda i: min(shapes[i]))
            allowed = min(shapes[largest])
            if not 1 <= rank <= allowed:
                raise ValueError(f"powersgd rank must be 1..{allowed}: the largest allowed rank is "
                                 f"{allowed}, min(n, m) of the largest matrix ({names[largest]}, "
                                 f"{shapes[largest][0]} x {shapes[largest][1]}), not {rank}")
        rng = np.random.default_rng(seed)
        self.shapes = {i: shapes[i] for i in self.matrices}
        self.ranks = {i: min(rank, *shapes[i]) for i in self.matrices}
        self.Q = {i: to_device(rng.standard_normal((shapes[i][1], self.ranks[i])).astype(dtype))
                  for i in self.matrices}
        self.error = {i: xp.zeros(shapes[i], dtype) for i in self.matrices}

    def average(self, comm, grads, step):
        """One power iteration for every matrix at once: all P's in one ring all-reduce,
        all Q's in another; the vectors in a third, uncompressed. Returns the averaged
        gradients (approximated for the matrices), one per parameter."""
        N, out = comm.Get_size(), list(grads)
        M = {i: grads[i].reshape(self.shapes[i]) + self.error[i] for i in self.matrices}
        if self.matrices:
            P = _all_reduce_parts(comm, {i: M[i] @ self.Q[i] for i in self.matrices})
            P = {i: orthogonalize(P[i]) for i in self.matrices}
            self.Q = _all_reduce_parts(comm, {i: M[i].T @ P[i] for i in self.matrices})
            for i in self.matrices:
                approx = P[i] @ self.Q[i].T / N
                self.error[i] = M[i] - approx     # what this rank put in and the average lacks
                out[i] = approx.reshape(grads[i].shape)
            self._redraw_zero_columns(step)
        if self.vectors:
            avg = _all_reduce_parts(comm, {i: grads[i] for i in self.vectors})
            for i in self.vectors:
                out[i] = avg[i] / N
        return out

    def _redraw_zero_columns(self, step):
        """A column of P that orthogonalize() zeroed (this step's summed M had rank < r: a
        matrix fed by a layer norm's output, whose rows sum to zero, does at the start)
        makes a zero column of Q, and the warm start would keep it zero for good (a full-rank
        run would stop being exact): draw it again, from (seed, step, matrix), the same on
        every rank, as the first Q was. Which columns died is read on the host in one
        transfer for all matrices (a flag per column)."""
        Q = self.Q
        m = ns(Q[self.matrices[0]])
        alive = to_numpy(m.concatenate([m.any(Q[i], axis=0) for i in self.matrices]))
        at = 0
        for i in self.matrices:
            r = self.ranks[i]
            dead = np.flatnonzero(~alive[at:at + r])
            at += r
            if dead.size == 0:
                continue
            fresh = np.random.default_rng([self.seed, step, i]).standard_normal(Q[i].shape)
            if on_device(Q[i]):
                fresh = to_device(fresh.astype(Q[i].dtype))
            Q[i] = Q[i].copy()
            Q[i][:, [int(c) for c in dead]] = fresh[:, [int(c) for c in dead]]

    def sent(self, size, rank):
        """Bytes this rank sends in one step (plan.traffic.powersgd_sent)."""
        matrices = [(*self.shapes[i], self.ranks[i]) for i in self.matrices]
        vectors = sum(self.sizes[i] for i in self.vectors)
        return powersgd_sent(matrices, vectors, size, rank, self.dtype.itemsize)

    def state_dict(self):
        """Host arrays (a device's brought home, counted: a checkpoint is host data)."""
        d = {}
        for i in self.matrices:
            d[f"powersgd.Q.{self.names[i]}"] = np.array(to_numpy(self.Q[i]))
            d[f"powersgd.error.{self.names[i]}"] = np.array(to_numpy(self.error[i]))
        return d

    def load_state_dict(self, d):
        for i in self.matrices:
            self.Q[i] = to_device(np.array(to_numpy(d[f"powersgd.Q.{self.names[i]}"]), self.dtype))
            self.error[i] = to_device(np.array(to_numpy(d[f"powersgd.error.{self.names[i]}"]), self.dtype))
