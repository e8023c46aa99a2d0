"""UCB1-Tuned (Auer, Cesa-Bianchi & Fischer 2002, section 4)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .base import ArmId, Policy
from .stats import ArmSums

__all__ = ["UCBTuned"]


class UCBTuned(Policy):
    """UCB1-Tuned: UCB1 with the bonus scaled by an upper bound on each arm's variance.

    Index of arm i after t observations, n_i on arm i, with empirical mean mu_i and empirical
    variance s_i^2 of its rewards (rescaled to [0, 1]):
    ``mu_i + sqrt(ln t / n_i * min(1/4, V_i))`` with ``V_i = s_i^2 + sqrt(2 ln t / n_i)``.
    A Bernoulli arm's variance is at most 1/4, hence the cap. Arms never observed come first
    (index +inf); ties are broken uniformly at random. Auer et al. give no regret bound for it
    but report it better than UCB1 in practice, mostly on low-variance arms.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] P. Auer, N. Cesa-Bianchi and P. Fischer, "Finite-time Analysis of the Multiarmed
       Bandit Problem", Machine Learning 47, 2002, section 4 ("UCB1-Tuned").
    """

    name = "ucb-tuned"
    requires_bounded_rewards = True
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.stats = ArmSums(self.n_arms, squares=True)

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        counts = self.stats.counts
        log_t = np.log(max(int(counts.sum()), 1))
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = self.stats.sums / counts
            var = np.maximum(self.stats.sq_sums / counts - mean * mean, 0.0)
            v = var + np.sqrt(2.0 * log_t / counts)
            index = mean + np.sqrt(log_t / counts * np.minimum(0.25, v))
        return np.where(counts > 0, index, np.inf)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.learn(idx, r)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
