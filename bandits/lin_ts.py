"""Linear Thompson sampling (Agrawal & Goyal 2013)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float
from .base import ArmId
from .linucb import _RidgePolicy

__all__ = ["LinearThompson"]


class LinearThompson(_RidgePolicy):
    """Linear Thompson sampling with a Gaussian posterior per arm.

    Arm a's coefficients have posterior ``N(theta_a, v^2 A_a^{-1})`` with the ridge statistics
    ``A_a = reg I + sum x x^T`` and ``theta_a = A_a^{-1} sum r x``. For context x the sampled
    reward ``x . theta~_a`` is exactly ``N(x . theta_a, v^2 x^T A_a^{-1} x)``, so one standard
    normal per (request, arm) is drawn instead of a d-dimensional sample; the largest sample is
    pulled. Any finite reward is accepted. The posterior is the same per-arm ridge regression as
    :class:`~adaptive_spec.bandits.LinUCB`'s (:class:`~adaptive_spec.bandits.stats.DisjointRidge`).

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    dim : int
        Context dimension d. Include a constant 1 feature for an intercept.
    v : float, default 1.0
        Posterior scale, > 0 (the analysis takes ``v = R sqrt(24 d ln(1/delta) / eps)``,
        far too wide in practice; about the reward noise's standard deviation works).
    reg : float, default 1.0
        Ridge regulariser, > 0.
    seed : int or None
        Seed of the posterior draws.

    References
    ----------
    .. [1] S. Agrawal and N. Goyal, "Thompson Sampling for Contextual Bandits with Linear
       Payoffs", ICML 2013.
    """

    name = "lin-ts"
    has_probabilities = False

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        dim: int,
        v: float = 1.0,
        reg: float = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, dim=dim, reg=reg, seed=seed)
        self.v = check_positive_float("v", v)

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        assert X is not None
        mean, var = self.stats.moments(X)
        return mean + self.v * np.sqrt(var) * self._rng.standard_normal(mean.shape)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"dim": 4}
        yield {"dim": 2, "v": 0.3, "reg": 2.0}
