"""Per-arm ridge-regression statistics shared by LinUCB and linear Thompson sampling."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DisjointRidge", "group_sum"]

_CHUNK = 1 << 14  # rows per chunk of the outer products (bounds memory for huge batches)


def group_sum(idx: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Sum the rows of ``values`` by group, ``out[g] = sum_{j: idx[j] = g} values[j]``.

    Parameters
    ----------
    idx : numpy.ndarray of int, shape [n]
        Group (arm) of each row, in ``[0, n_groups)``.
    values : numpy.ndarray of float, shape [n, ...]
        Rows to add up.
    n_groups : int
        Number of groups K.

    Returns
    -------
    numpy.ndarray of float64, shape [n_groups, ...]
        Per-group sums (zeros for empty groups). Uses a stable sort and ``np.add.reduceat``
        rather than a one-hot matrix product, which multithreaded BLAS makes slow for small
        sizes on a loaded machine.
    """
    out = np.zeros((n_groups, *values.shape[1:]))
    if idx.shape[0] == 0:
        return out
    order = np.argsort(idx, kind="stable")
    s = idx[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    out[s[starts]] = np.add.reduceat(values[order], starts, axis=0)
    return out


def _outer_group_sum(idx: np.ndarray, X: np.ndarray, Z: np.ndarray, n_groups: int) -> np.ndarray:
    """``out[g] = sum_{j in g} X[j] Z[j]^T``, shape ``[n_groups, dx, dz]``, in bounded memory."""
    out = np.zeros((n_groups, X.shape[1], Z.shape[1]))
    for start in range(0, idx.shape[0], _CHUNK):
        sl = slice(start, start + _CHUNK)
        out += group_sum(idx[sl], X[sl, :, None] * Z[sl, None, :], n_groups)
    return out


class DisjointRidge:
    """One ridge regression per arm: ``A_a = reg I + sum x x^T``, ``b_a = sum r x``.

    Keeps ``A_a^{-1}`` and ``theta_a = A_a^{-1} b_a`` up to date for the arms touched by each
    batch (a batched LAPACK inverse of the ``dim x dim`` matrices).

    Parameters
    ----------
    n_arms : int
        Number of arms K.
    dim : int
        Context dimension d.
    reg : float
        Ridge regulariser (prior precision), > 0.
    """

    def __init__(self, n_arms: int, dim: int, reg: float) -> None:
        self.n_arms, self.dim, self.reg = n_arms, dim, reg
        self.A = np.broadcast_to(reg * np.eye(dim), (n_arms, dim, dim)).copy()
        self.b = np.zeros((n_arms, dim))
        self.A_inv = np.broadcast_to(np.eye(dim) / reg, (n_arms, dim, dim)).copy()
        self.theta = np.zeros((n_arms, dim))

    def refresh(self, arms: np.ndarray | None = None) -> None:
        """Recompute inverse and coefficients for ``arms`` (all by default)."""
        sel = slice(None) if arms is None else arms
        inv = np.linalg.inv(self.A[sel])
        self.A_inv[sel] = inv
        self.theta[sel] = np.einsum("kij,kj->ki", inv, self.b[sel])

    def learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray) -> None:
        """Add observations ``(idx[j], r[j], X[j])``; order-independent up to rounding."""
        self.A += _outer_group_sum(idx, X, X, self.n_arms)
        self.b += group_sum(idx, X * r[:, None], self.n_arms)
        self.refresh(np.unique(idx))

    def moments(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predicted mean ``x . theta_a`` and ``x^T A_a^{-1} x`` for every row and arm, ``[n, K]``."""
        mean = X @ self.theta.T
        var = np.einsum("knd,nd->nk", X @ self.A_inv, X)
        return mean, np.maximum(var, 0.0)

    def get_data(self) -> dict[str, Any]:
        """Sufficient statistics (the inverse is derived)."""
        return {"A": self.A, "b": self.b}

    def set_data(self, data: dict[str, Any]) -> None:
        """Restore :meth:`get_data`'s output and recompute the derived arrays."""
        k, d = self.n_arms, self.dim
        A = np.asarray(data["A"], dtype=np.float64)
        b = np.asarray(data["b"], dtype=np.float64)
        if A.shape != (k, d, d) or b.shape != (k, d):
            raise ValueError(f"A must be [{k}, {d}, {d}] and b [{k}, {d}]")
        if not (np.isfinite(A).all() and np.isfinite(b).all()):
            raise ValueError("A and b must be finite")
        self.A, self.b = A, b
        self.refresh()
