"""LinUCB with hybrid (shared + per-arm) linear models (Li et al. 2010, Algorithm 2)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_array_field, check_finite_array, check_positive_float
from .base import ArmId, Policy
from .stats import group_sum, outer_group_sum

__all__ = ["LinUCBHybrid"]


class LinUCBHybrid(Policy):
    """LinUCB (hybrid): reward ``z_{x,a} . beta + x . theta_a`` with beta shared by all arms.

    The shared features are ``z_{x,a} = kron(f_a, x)`` for documented per-arm features
    ``f_a`` (``arm_features[a]``, e.g. a proposer one-hot and k / k_max), so what is learned
    about one arm carries over to similar arms; without ``arm_features``, ``z_{x,a} = x`` (a
    common baseline learned from every arm's data plus per-arm deviations theta_a).

    This is the joint ridge regression over ``(beta, theta_1..theta_K)`` computed blockwise as
    in Algorithm 2: with ``A_a = reg I + sum x x^T``, ``B_a = sum x z^T``, ``b_a = sum r x``
    (per arm) and ``A_0 = reg I + sum z z^T - sum_a B_a^T A_a^{-1} B_a``,
    ``b_0 = sum r z - sum_a B_a^T A_a^{-1} b_a`` (the Schur complement), ``beta = A_0^{-1} b_0``
    and ``theta_a = A_a^{-1}(b_a - B_a beta)``. The score is the mean plus ``alpha sqrt(s)``,
    ``s = u^T A_0^{-1} u + x^T A_a^{-1} x`` with ``u = z - B_a^T A_a^{-1} x``, which expands to
    Algorithm 2's four-term ``s_{t,a}``. Since ``z_{x,a} = P_a x`` is linear in x
    (``P_a = kron(f_a, I_d)``), the mean and ``s`` are precomputed after each update as a vector
    and a ``d x d`` matrix per arm, so choosing arms for a batch costs what disjoint LinUCB's
    does. Any finite reward is accepted.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    dim : int
        Context dimension d.
    arm_features : array_like of float, shape [K, m], optional
        Features of each arm, in :attr:`arms` order. Shared dimension ``m * d`` (``d`` if
        omitted).
    alpha : float, default 1.0
        Width of the confidence bound, >= 0.
    reg : float, default 1.0
        Ridge regulariser of both the shared and the per-arm coefficients, > 0.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] L. Li, W. Chu, J. Langford and R. E. Schapire, "A Contextual-Bandit Approach to
       Personalized News Article Recommendation", WWW 2010, Algorithm 2.
    """

    name = "linucb-hybrid"
    contextual = True

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        dim: int,
        arm_features: np.ndarray | None = None,
        alpha: float = 1.0,
        reg: float = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, dim=dim)
        self.alpha = check_positive_float("alpha", alpha, allow_zero=True)
        self.reg = check_positive_float("reg", reg)
        d = int(self._dim or 0)
        if arm_features is None:
            self._features: np.ndarray | None = None
            k_shared = d
        else:
            F = np.asarray(arm_features, dtype=np.float64)
            if F.ndim != 2 or F.shape[0] != self.n_arms or F.shape[1] < 1:
                raise ValueError(
                    f"arm_features must have shape [{self.n_arms}, m], got shape {F.shape}"
                )
            check_finite_array("arm_features", F)
            self._features = F
            k_shared = F.shape[1] * d
        self._k = k_shared
        K = self.n_arms
        self._Z0 = self.reg * np.eye(k_shared)
        self._bz = np.zeros(k_shared)
        self._A = np.broadcast_to(self.reg * np.eye(d), (K, d, d)).copy()
        self._B = np.zeros((K, d, k_shared))
        self._b = np.zeros((K, d))
        self._refresh()

    # ---------------------------------------------------------------- model
    def _refresh(self) -> None:
        self._A_inv = np.linalg.inv(self._A)
        self._C = np.einsum("kdj,kde->kje", self._B, self._A_inv)  # B_a^T A_a^{-1}, [K, k, d]
        A0 = self._Z0 - np.einsum("kje,kel->jl", self._C, self._B)
        b0 = self._bz - np.einsum("kje,ke->j", self._C, self._b)
        self._A0_inv = np.linalg.inv(A0)
        self._beta = self._A0_inv @ b0
        resid = self._b - self._B @ self._beta
        self._theta = np.einsum("kde,ke->kd", self._A_inv, resid)
        # z_{x,a} = P_a x is linear in x, so the mean and s are quadratic forms in x alone:
        # mean = x . (P_a^T beta + theta_a), s = x^T (D_a^T A_0^{-1} D_a + A_a^{-1}) x with
        # D_a = P_a - B_a^T A_a^{-1}. Precomputing them makes a decision cost what LinUCB's does.
        P = self._shared_maps()
        D = P - self._C
        self._w_eff = self._beta @ P + self._theta
        S = D.transpose(0, 2, 1) @ (self._A0_inv @ D) + self._A_inv
        self._S = 0.5 * (S + S.transpose(0, 2, 1))

    def _shared_maps(self) -> np.ndarray:
        """``P_a`` with ``z_{x,a} = P_a x``: ``I_d`` or ``kron(f_a, I_d)``, ``[K, k, d]``."""
        d = int(self._dim or 0)
        if self._features is None:
            return np.broadcast_to(np.eye(d), (self.n_arms, d, d))
        F = self._features
        return (F[:, :, None, None] * np.eye(d)[None, None, :, :]).reshape(self.n_arms, self._k, d)

    def _z_rows(self, idx: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Shared features of the observed (row, arm) pairs, ``[n, k]``."""
        if self._features is None:
            return X
        F = self._features[idx]
        return (F[:, :, None] * X[:, None, :]).reshape(X.shape[0], self._k)

    @property
    def arm_features(self) -> np.ndarray | None:
        """Features of each arm, float64 ``[K, m]``, or ``None``."""
        return self._features

    @property
    def beta(self) -> np.ndarray:
        """Shared coefficients, float64 ``[k]`` (a copy)."""
        return self._beta.copy()

    @property
    def theta(self) -> np.ndarray:
        """Per-arm coefficients, float64 ``[K, dim]`` (a copy)."""
        return self._theta.copy()

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean reward and its confidence width ``sqrt(s)`` for every row and arm.

        Parameters
        ----------
        X : numpy.ndarray of float64, shape [n, dim]
            Validated contexts.

        Returns
        -------
        (numpy.ndarray, numpy.ndarray)
            Means and widths, float64 ``[n, K]`` each.
        """
        mean = X @ self._w_eff.T
        s = np.einsum("knd,nd->nk", X @ self._S, X)
        return mean, np.sqrt(np.maximum(s, 0.0))

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        assert X is not None
        mean, width = self.predict(X)
        return mean + self.alpha * width

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        assert X is not None
        Z = self._z_rows(idx, X)
        K = self.n_arms
        self._Z0 += Z.T @ Z
        self._bz += Z.T @ r
        self._A += outer_group_sum(idx, X, X, K)
        self._B += outer_group_sum(idx, X, Z, K)
        self._b += group_sum(idx, X * r[:, None], K)
        self._refresh()

    # ---------------------------------------------------------------- state
    def _get_data(self) -> dict[str, Any]:
        return {"Z0": self._Z0, "bz": self._bz, "A": self._A, "B": self._B, "b": self._b}

    def _set_data(self, data: dict[str, Any]) -> None:
        K, d, k = self.n_arms, int(self._dim or 0), self._k
        self._Z0 = check_array_field(data, "Z0", (k, k))
        self._bz = check_array_field(data, "bz", (k,))
        self._A = check_array_field(data, "A", (K, d, d))
        self._B = check_array_field(data, "B", (K, d, k))
        self._b = check_array_field(data, "b", (K, d))
        self._refresh()

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"dim": 4}
        yield {"dim": 3, "arm_features": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], "alpha": 0.5}
