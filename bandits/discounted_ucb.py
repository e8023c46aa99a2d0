"""Discounted UCB (Kocsis & Szepesvári 2006; Garivier & Moulines 2011)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float, check_unit_interval
from .base import ArmId, Policy, check_array_field

__all__ = ["DiscountedUCB", "discount_weights"]


def discount_weights(gamma: float, n: int) -> np.ndarray:
    """Weights ``gamma^(n-1-j)`` of the j-th of n observations learned in one batch, ``[n]``.

    Learning a batch with these weights after multiplying the old statistics by ``gamma^n``
    equals learning the n observations one at a time (each one discounting everything before).
    """
    return gamma ** np.arange(n - 1, -1, -1, dtype=np.float64)


class DiscountedUCB(Policy):
    """D-UCB: UCB on exponentially discounted counts and rewards, for drifting rewards.

    Every observation multiplies all arms' statistics by ``gamma``:
    ``N_i <- gamma N_i + 1{arm i}``, ``S_i <- gamma S_i + r 1{arm i}`` (rewards rescaled to
    [0, 1]). The index is ``S_i / N_i + 2 sqrt(xi ln(n_t) / N_i)`` with ``n_t = sum_i N_i``
    (+inf for an arm never observed). The effective memory is about ``1 / (1 - gamma)``
    observations; Garivier & Moulines take ``1 - gamma ~ sqrt(Upsilon / T) / 4`` for Upsilon
    changes in T rounds. The discount is applied per observation, so a batch of n updates
    equals n single updates.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    gamma : float, default 0.99
        Discount factor in (0, 1].
    xi : float, default 0.6
        Exploration constant (> 1/2 in the analysis), > 0.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] L. Kocsis and C. Szepesvári, "Discounted UCB", 2nd PASCAL Challenges Workshop, 2006.
    .. [2] A. Garivier and E. Moulines, "On Upper-Confidence Bound Policies for Switching
       Bandit Problems", ALT 2011 (D-UCB).
    """

    name = "discounted-ucb"
    requires_bounded_rewards = True

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        gamma: float = 0.99,
        xi: float = 0.6,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.gamma = check_unit_interval("gamma", gamma)
        self.xi = check_positive_float("xi", xi)
        self._disc_counts = np.zeros(self.n_arms)
        self._disc_sums = np.zeros(self.n_arms)

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        counts = self._disc_counts
        log_n = max(float(np.log(max(counts.sum(), 1.0))), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            index = self._disc_sums / counts + 2.0 * np.sqrt(self.xi * log_n / counts)
        return np.where(counts > 0, index, np.inf)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        n = idx.shape[0]
        w = discount_weights(self.gamma, n)
        decay = self.gamma**n
        self._disc_counts = decay * self._disc_counts + np.bincount(
            idx, weights=w, minlength=self.n_arms
        )
        self._disc_sums = decay * self._disc_sums + np.bincount(
            idx, weights=w * r, minlength=self.n_arms
        )

    def _params(self) -> dict[str, Any]:
        return {
            **self._base_params(),
            "gamma": self.gamma,
            "xi": self.xi,
            "reward_range": self._reward_range,
        }

    def _get_data(self) -> dict[str, Any]:
        return {"disc_counts": self._disc_counts, "disc_sums": self._disc_sums}

    def _set_data(self, data: dict[str, Any]) -> None:
        self._disc_counts = check_array_field(data, "disc_counts", (self.n_arms,))
        self._disc_sums = check_array_field(data, "disc_sums", (self.n_arms,))

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"gamma": 0.9, "xi": 1.0}
