"""Discounted UCB (Kocsis & Szepesvári 2006; Garivier & Moulines 2011)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from ._validation import check_positive_float, check_unit_interval
from .base import ArmId
from .stats import ArmSums
from .ucb1 import _IndexUCB

__all__ = ["DiscountedUCB"]


class DiscountedUCB(_IndexUCB):
    """D-UCB: UCB on exponentially discounted counts and rewards, for drifting rewards.

    Every observation multiplies all arms' statistics by ``gamma``:
    ``N_i <- gamma N_i + 1{arm i}``, ``S_i <- gamma S_i + r 1{arm i}`` (rewards rescaled to
    [0, 1]; a :class:`~adaptive_spec.bandits.stats.ArmSums` with discount). The index is
    ``S_i / N_i + 2 sqrt(xi ln(n_t) / N_i)`` with ``n_t = sum_i N_i`` (+inf for an arm never
    observed). The effective memory is about ``1 / (1 - gamma)`` observations; Garivier &
    Moulines take ``1 - gamma ~ sqrt(Upsilon / T) / 4`` for Upsilon changes in T rounds. The
    discount is applied per observation, so a batch of n updates equals n single updates.

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
        self.width = 2.0 * math.sqrt(self.xi)
        self.stats = ArmSums(self.n_arms, gamma=self.gamma)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"gamma": 0.9, "xi": 1.0}
