"""Gaussian Thompson sampling (Agrawal & Goyal 2013)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float
from .base import ArmId, Policy
from .stats import ArmSums

__all__ = ["ThompsonGaussian"]


class ThompsonGaussian(Policy):
    """Thompson sampling with a conjugate Gaussian posterior on each arm's mean reward.

    Rewards are modelled as ``N(mu_i, noise_var)`` with prior ``mu_i ~ N(prior_mean,
    prior_var)``. After n_i rewards summing to S_i, arm i's posterior has precision
    ``1 / prior_var + n_i / noise_var`` and mean ``(prior_mean / prior_var + S_i / noise_var)
    / precision``. Each pull draws one sample per arm (per request in a batch) and takes the
    largest. Any finite reward is accepted (e.g. tokens per second).

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    prior_mean : float, default 0.0
        Prior mean of every arm's mean reward.
    prior_var : float, default 1.0
        Prior variance, > 0.
    noise_var : float, default 1.0
        Assumed reward noise variance, > 0 (scale it to the rewards' units).
    seed : int or None
        Seed of the posterior draws.

    References
    ----------
    .. [1] S. Agrawal and N. Goyal, "Further Optimal Regret Bounds for Thompson Sampling",
       AISTATS 2013 (Gaussian priors).
    """

    name = "thompson-gaussian"
    has_probabilities = False
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        prior_mean: float = 0.0,
        prior_var: float = 1.0,
        noise_var: float = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed)
        if isinstance(prior_mean, bool) or not np.isfinite(prior_mean):
            raise ValueError(f"prior_mean must be a finite number, got {prior_mean!r}")
        self.prior_mean = float(prior_mean)
        self.prior_var = check_positive_float("prior_var", prior_var)
        self.noise_var = check_positive_float("noise_var", noise_var)
        self.stats = ArmSums(self.n_arms)

    @property
    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and variance of every arm's mean reward, float64 ``[K]`` each."""
        prec = 1.0 / self.prior_var + self.stats.counts / self.noise_var
        mean = (self.prior_mean / self.prior_var + self.stats.sums / self.noise_var) / prec
        return mean, 1.0 / prec

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        mean, var = self.posterior
        return mean + np.sqrt(var) * self._rng.standard_normal((n, self.n_arms))

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.learn(idx, r)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"prior_mean": 0.5, "prior_var": 4.0, "noise_var": 0.25}
