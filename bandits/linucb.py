"""LinUCB with disjoint linear models (Li, Chu, Langford & Schapire 2010, Algorithm 1)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float
from .base import ArmId, Policy
from .stats import DisjointRidge

__all__ = ["LinUCB"]


class LinUCB(Policy):
    """LinUCB (disjoint): a ridge regression per arm and an upper confidence bound on x . theta_a.

    For context x (shape ``[dim]``), arm a's score is
    ``x . theta_a + alpha sqrt(x^T A_a^{-1} x)`` with ``A_a = reg I + sum x x^T`` and
    ``theta_a = A_a^{-1} sum r x`` over arm a's observations; the largest score is pulled
    (ties uniformly at random). Any finite reward is accepted. A batch of n contexts is scored
    for all K arms at once (``O(n K d^2)``).

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    dim : int
        Context dimension d. Include a constant 1 feature for an intercept.
    alpha : float, default 1.0
        Width of the confidence bound, >= 0 (Li et al.: ``1 + sqrt(ln(2/delta) / 2)``).
    reg : float, default 1.0
        Ridge regulariser, > 0.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] L. Li, W. Chu, J. Langford and R. E. Schapire, "A Contextual-Bandit Approach to
       Personalized News Article Recommendation", WWW 2010, Algorithm 1.

    Examples
    --------
    >>> import numpy as np
    >>> policy = LinUCB(["none", "ngram"], dim=2, alpha=0.1, seed=0)
    >>> X = np.array([[1.0, 0.0], [1.0, 1.0]] * 20)  # intercept, "prompt repeats itself"
    >>> policy.update_batch(["none"] * 40, np.full(40, 0.5), X)
    >>> policy.update_batch(["ngram"] * 40, X[:, 1], X)  # n-gram pays only on repetition
    >>> policy.pull_batch(np.array([[1.0, 1.0], [1.0, 0.0]]))
    ['ngram', 'none']
    """

    name = "linucb"
    contextual = True
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        dim: int,
        alpha: float = 1.0,
        reg: float = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, dim=dim)
        self.alpha = check_positive_float("alpha", alpha, allow_zero=True)
        self.reg = check_positive_float("reg", reg)
        self.stats = DisjointRidge(self.n_arms, int(self._dim or 0), self.reg)

    @property
    def theta(self) -> np.ndarray:
        """Ridge coefficients of every arm, float64 ``[K, dim]`` (a copy)."""
        return self.stats.theta.copy()

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        assert X is not None
        mean, var = self.stats.moments(X)
        return mean + self.alpha * np.sqrt(var)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        assert X is not None
        self.stats.learn(idx, r, X)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"dim": 4}
        yield {"dim": 3, "alpha": 0.0, "reg": 0.5}
