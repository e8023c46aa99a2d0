"""Epsilon-greedy with decaying exploration (Sutton & Barto; Auer et al. 2002)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._choice import uniform_over_max
from ._validation import check_positive_float, check_unit_interval
from .base import ArmId, Policy
from .stats import ArmSums

__all__ = ["EpsilonGreedy"]


class EpsilonGreedy(Policy):
    """Epsilon-greedy: explore uniformly with probability eps_t, else pull the best mean.

    ``eps_t = epsilon / (1 + decay * t)`` after t observations; the greedy arm maximises the
    empirical mean reward, arms never observed first (ties uniformly at random). With
    ``epsilon = 1`` and ``decay = d^2 / (c K)`` this is Auer et al.'s epsilon_n-greedy,
    ``eps_t = min(1, c K / (d^2 t))``, whose regret is logarithmic for a suitable c and a lower
    bound d on the gap. :meth:`probabilities` gives the exact action distribution
    ``(1 - eps_t) * greedy + eps_t / K``. Any finite reward is accepted.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    epsilon : float, default 0.1
        Initial exploration probability, in [0, 1].
    decay : float, default 0.0
        Decay rate of the exploration probability per observation, >= 0 (0: constant).
    seed : int or None
        Seed of the exploration draws.

    References
    ----------
    .. [1] R. S. Sutton and A. G. Barto, "Reinforcement Learning: An Introduction", 2nd ed.,
       2018, section 2.2.
    .. [2] P. Auer, N. Cesa-Bianchi and P. Fischer, "Finite-time Analysis of the Multiarmed
       Bandit Problem", Machine Learning 47, 2002 (Theorem 3, epsilon_n-greedy).
    """

    name = "epsilon-greedy"
    randomized = True
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        epsilon: float = 0.1,
        decay: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed)
        self.epsilon = check_unit_interval("epsilon", epsilon, low_open=False)
        self.decay = check_positive_float("decay", decay, allow_zero=True)
        self.stats = ArmSums(self.n_arms)

    @property
    def current_epsilon(self) -> float:
        """Exploration probability for the next pull."""
        return self.epsilon / (1.0 + self.decay * self.n_updates)

    def _probs(self, X: np.ndarray | None, n: int) -> np.ndarray:
        means = np.where(self.stats.counts > 0, self.stats.means(), np.inf)  # unseen arms first
        eps = self.current_epsilon
        return (1.0 - eps) * uniform_over_max(means) + eps / self.n_arms

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.learn(idx, r)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"epsilon": 1.0, "decay": 0.01}
