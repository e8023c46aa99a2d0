"""Beta-Bernoulli Thompson sampling (Thompson 1933; Agrawal & Goyal 2012)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float
from .base import ArmId, Policy
from .stats import BetaPosterior

__all__ = ["ThompsonBeta"]


class ThompsonBeta(Policy):
    """Thompson sampling with a Beta posterior on each arm's success probability.

    Arm i's posterior is ``Beta(alpha0 + S_i, beta0 + F_i)`` where ``S_i`` sums its rewards and
    ``F_i`` sums one minus its rewards (rewards rescaled to [0, 1] from ``reward_range``; a
    fractional reward r counts as r of a success and 1 - r of a failure, the expected update
    of Agrawal & Goyal's Bernoulli trick without its extra noise; a
    :class:`~adaptive_spec.bandits.stats.BetaPosterior`). Each pull draws one sample
    per arm (per request in a batch) and takes the largest. Regret is
    ``O(sum_i ln T / gap_i)``, asymptotically optimal for Bernoulli rewards.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    alpha0, beta0 : float, default 1.0
        Prior pseudo-counts (1, 1 is the uniform prior), > 0.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed of the posterior draws.

    References
    ----------
    .. [1] W. R. Thompson, "On the likelihood that one unknown probability exceeds another in
       view of the evidence of two samples", Biometrika 25, 1933.
    .. [2] S. Agrawal and N. Goyal, "Analysis of Thompson Sampling for the Multi-armed Bandit
       Problem", COLT 2012.
    .. [3] O. Chapelle and L. Li, "An Empirical Evaluation of Thompson Sampling", NeurIPS 2011.
    """

    name = "thompson-beta"
    requires_bounded_rewards = True
    has_probabilities = False
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        alpha0: float = 1.0,
        beta0: float = 1.0,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.alpha0 = check_positive_float("alpha0", alpha0)
        self.beta0 = check_positive_float("beta0", beta0)
        self.stats = BetaPosterior(self.n_arms, self.alpha0, self.beta0)

    @property
    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Beta parameters ``(alpha, beta)`` of every arm, float64 ``[K]`` each."""
        return self.stats.params()

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        return self.stats.sample(self._rng, n)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.learn(idx, r)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"alpha0": 0.5, "beta0": 2.0}
