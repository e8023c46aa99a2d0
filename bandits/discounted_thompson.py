"""Discounted Thompson sampling (Raj & Kalyani 2017)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float, check_unit_interval
from .base import ArmId, Policy, check_array_field
from .discounted_ucb import discount_weights

__all__ = ["DiscountedThompson"]


class DiscountedThompson(Policy):
    """Beta-Bernoulli Thompson sampling whose evidence decays geometrically.

    Every observation multiplies all arms' success and failure pseudo-counts by ``gamma``
    and adds the new reward r (rescaled to [0, 1]) to the pulled arm: ``S_i <- gamma S_i + r``,
    ``F_i <- gamma F_i + (1 - r)``. Pulls sample ``Beta(alpha0 + S_i, beta0 + F_i)`` per arm
    and take the largest, so an arm not pulled for a while regains prior-level uncertainty and
    is explored again. The discount is applied per observation (a batch of n updates equals
    n single updates).

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    gamma : float, default 0.99
        Discount factor in (0, 1].
    alpha0, beta0 : float, default 1.0
        Prior pseudo-counts, > 0.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed of the posterior draws.

    References
    ----------
    .. [1] V. Raj and S. Kalyani, "Taming Non-stationary Bandits: A Bayesian Approach",
       arXiv:1707.09727, 2017 (discounted Thompson sampling, dTS).
    """

    name = "discounted-thompson"
    requires_bounded_rewards = True
    has_probabilities = False

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        gamma: float = 0.99,
        alpha0: float = 1.0,
        beta0: float = 1.0,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.gamma = check_unit_interval("gamma", gamma)
        self.alpha0 = check_positive_float("alpha0", alpha0)
        self.beta0 = check_positive_float("beta0", beta0)
        self._successes = np.zeros(self.n_arms)
        self._failures = np.zeros(self.n_arms)

    @property
    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Beta parameters ``(alpha, beta)`` of every arm, float64 ``[K]`` each."""
        return self.alpha0 + self._successes, self.beta0 + self._failures

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        a, b = self.posterior
        return self._rng.beta(a, b, size=(n, self.n_arms))

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        n = idx.shape[0]
        w = discount_weights(self.gamma, n)
        decay = self.gamma**n
        k = self.n_arms
        self._successes = decay * self._successes + np.bincount(idx, weights=w * r, minlength=k)
        self._failures = decay * self._failures + np.bincount(
            idx, weights=w * (1.0 - r), minlength=k
        )

    def _params(self) -> dict[str, Any]:
        return {
            **self._base_params(),
            "gamma": self.gamma,
            "alpha0": self.alpha0,
            "beta0": self.beta0,
            "reward_range": self._reward_range,
        }

    def _get_data(self) -> dict[str, Any]:
        return {"successes": self._successes, "failures": self._failures}

    def _set_data(self, data: dict[str, Any]) -> None:
        self._successes = check_array_field(data, "successes", (self.n_arms,))
        self._failures = check_array_field(data, "failures", (self.n_arms,))

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"gamma": 0.9, "alpha0": 2.0}
