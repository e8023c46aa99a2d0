"""EXP3 in the log domain (Auer, Cesa-Bianchi, Freund & Schapire 2002)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_int, check_rate_or_horizon, check_unit_interval
from .base import ArmId, Policy
from .stats import ExpWeights

__all__ = ["Exp3"]


class Exp3(Policy):
    """EXP3: exponential weights over importance-weighted reward estimates, for adversarial rewards.

    The arm is drawn from ``p_i = (1 - gamma) w_i / sum_j w_j + gamma / K``; after observing
    reward r (rescaled to [0, 1]) of the pulled arm i, ``w_i <- w_i exp(gamma r / (p_i K))``.
    The weights are kept as logarithms, ``ln w_i = gamma G_i / K`` with the estimated cumulative
    gains ``G_i`` re-centred to a maximum of 0 after every update
    (:class:`~adaptive_spec.bandits.stats.ExpWeights`, shared with Hedge), so they never
    overflow: the probabilities stay exact for any number of updates (river's ``Exp3``
    multiplies raw weights and overflows after about 61k updates).
    With gamma tuned to a horizon T (``gamma = min(1, sqrt(K ln K / ((e - 1) T)))``) the
    expected regret against the best fixed arm is at most ``2 sqrt(e - 1) sqrt(T K ln K)``
    (about ``2.63 sqrt(T K ln K)``), for any reward sequence.

    :meth:`update_batch` uses the current probabilities, i.e. the ones a batch from
    :meth:`pull_batch` was drawn with. :meth:`update_full` (every arm's reward known) applies
    the unweighted exponential-weights step ``w_i <- w_i exp(gamma r_i / K)``.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    gamma : float, optional
        Exploration rate in (0, 1]. Default: tuned to ``horizon`` if given, else 0.1.
    horizon : int, optional
        Number of rounds T to tune gamma for.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed of the arm draws.

    Raises
    ------
    ValueError
        If both ``gamma`` and ``horizon`` are given, or either is out of range.

    References
    ----------
    .. [1] P. Auer, N. Cesa-Bianchi, Y. Freund and R. E. Schapire, "The Nonstochastic
       Multiarmed Bandit Problem", SIAM Journal on Computing 32(1), 2002 (Corollary 3.2).

    Examples
    --------
    >>> policy = Exp3(["a", "b"], gamma=0.2, seed=0)
    >>> policy.probabilities().tolist()
    [0.5, 0.5]
    >>> policy.update("a", 1.0)
    >>> bool(policy.probabilities()[0] > 0.5)
    True
    """

    name = "exp3"
    randomized = True
    requires_bounded_rewards = True
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        gamma: float | None = None,
        horizon: int | None = None,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        gamma, self.horizon = check_rate_or_horizon("gamma", gamma, horizon, check_unit_interval)
        if gamma is None:
            k = self.n_arms
            gamma = (
                0.1
                if horizon is None
                else min(1.0, math.sqrt(k * math.log(k) / ((math.e - 1.0) * self.horizon)))
            )
            if gamma == 0.0:  # one arm: nothing to explore
                gamma = 1.0
        self.gamma = check_unit_interval("gamma", gamma)
        self.stats = ExpWeights(self.n_arms)

    def _probs(self, X: np.ndarray | None, n: int) -> np.ndarray:
        k = self.n_arms
        return (1.0 - self.gamma) * self.stats.softmax(self.gamma / k) + self.gamma / k

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        p = self._probs(None, 1)
        self.stats.add(np.bincount(idx, weights=r / p[idx], minlength=self.n_arms))

    def _learn_full(self, R: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.add(R.sum(axis=0))

    def _params(self) -> dict[str, Any]:
        # gamma is stored resolved, so horizon is not needed to rebuild (it is kept as data).
        return {k: v for k, v in super()._params().items() if k != "horizon"}

    def _get_data(self) -> dict[str, Any]:
        return {**super()._get_data(), "horizon": self.horizon}

    def _set_data(self, data: dict[str, Any]) -> None:
        super()._set_data(data)
        h = data["horizon"]
        self.horizon = None if h is None else check_positive_int("horizon", h)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"horizon": 1000}
        yield {"gamma": 1.0}
