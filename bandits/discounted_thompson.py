"""Discounted Thompson sampling (Raj & Kalyani 2017)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ._validation import check_unit_interval
from .base import ArmId
from .stats import BetaPosterior
from .thompson_beta import ThompsonBeta

__all__ = ["DiscountedThompson"]


class DiscountedThompson(ThompsonBeta):
    """Beta-Bernoulli Thompson sampling whose evidence decays geometrically.

    Every observation multiplies all arms' success and failure pseudo-counts by ``gamma``
    and adds the new reward r (rescaled to [0, 1]) to the pulled arm: ``S_i <- gamma S_i + r``,
    ``F_i <- gamma F_i + (1 - r)``. Pulls sample ``Beta(alpha0 + S_i, beta0 + F_i)`` per arm
    and take the largest, so an arm not pulled for a while regains prior-level uncertainty and
    is explored again. The discount is applied per observation (a batch of n updates equals
    n single updates). :class:`~adaptive_spec.bandits.ThompsonBeta` with a discounted
    :class:`~adaptive_spec.bandits.stats.BetaPosterior`.

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
        super().__init__(arms, alpha0=alpha0, beta0=beta0, reward_range=reward_range, seed=seed)
        self.gamma = check_unit_interval("gamma", gamma)
        self.stats = BetaPosterior(self.n_arms, self.alpha0, self.beta0, gamma=self.gamma)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"gamma": 0.9, "alpha0": 2.0}
