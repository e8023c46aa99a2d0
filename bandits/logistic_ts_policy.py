"""Contextual Thompson sampling over per-arm Bayesian logistic regressions (Chapelle & Li 2011)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from scipy.special import expit

from ._validation import check_array_field, check_positive_float, check_unit_interval
from .base import ArmId, Policy
from .logistic_ts import laplace_update_grouped

__all__ = ["LogisticThompsonPolicy"]


class LogisticThompsonPolicy(Policy):
    """Thompson sampling for binary rewards with one diagonal-Laplace logistic model per arm.

    Arm a models ``P(reward = 1 | x) = sigmoid(w_a . x)`` with ``w_a ~ N(m_a, diag(1/q_a))``,
    updated per batch by Chapelle & Li's Algorithm 3 (the same update as
    :class:`~adaptive_spec.bandits.LogisticThompson`, with optional forgetting). Each pull draws
    one logit per (request, arm), exactly ``N(m_a . x, sum_i x_i^2 / q_ai)``, and pulls the
    largest; all K arms of a batch of n requests are scored in one vectorised step. Rewards
    must be 0 or 1 (e.g. "the draft token at this position was accepted").

    An update batch is split by arm; each arm's rows form one Algorithm-3 batch, and forgetting
    (``discount < 1``) applies to an arm only when it receives data.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    dim : int
        Context dimension d. Include a constant 1 feature for an intercept.
    prior_var : float, default 1.0
        Prior variance of every weight, > 0.
    discount : float, default 1.0
        Forgetting factor in (0, 1] (1: stationary).
    seed : int or None
        Seed of the posterior draws.

    References
    ----------
    .. [1] O. Chapelle and L. Li, "An Empirical Evaluation of Thompson Sampling", NeurIPS 2011,
       Algorithm 3.
    """

    name = "logistic-ts"
    contextual = True
    has_probabilities = False
    binary_rewards = True

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        dim: int,
        prior_var: float = 1.0,
        discount: float = 1.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, dim=dim)
        self.prior_var = check_positive_float("prior_var", prior_var)
        self.discount = check_unit_interval("discount", discount)
        d = int(self._dim or 0)
        self._means = np.zeros((self.n_arms, d))
        self._precs = np.full((self.n_arms, d), 1.0 / self.prior_var)

    def predict_proba(self, contexts: np.ndarray) -> np.ndarray:
        """Posterior-mean probability of reward 1 for every request and arm.

        Uses MacKay's probit approximation ``sigmoid(mu / sqrt(1 + pi var / 8))`` of the
        logit's posterior mean ``mu`` and variance ``var``, as
        :meth:`LogisticThompson.predict_proba <adaptive_spec.bandits.LogisticThompson.predict_proba>`.

        Parameters
        ----------
        contexts : array_like of float, shape [n, dim]

        Returns
        -------
        numpy.ndarray of float64, shape [n, K]

        Raises
        ------
        ValueError
            If ``contexts`` is not ``[n, dim]`` or holds NaN/inf.
        """
        X, _ = self._check_contexts(contexts, None)
        assert X is not None
        mu, var = self._logit_moments(X)
        return expit(mu / np.sqrt(1.0 + (np.pi / 8.0) * var))

    def _logit_moments(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and variance of every arm's logit for every row, ``[n, K]`` each."""
        return X @ self._means.T, (X * X) @ (1.0 / self._precs).T

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        assert X is not None
        mu, var = self._logit_moments(X)
        return mu + np.sqrt(var) * self._rng.standard_normal(mu.shape)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        assert X is not None
        touched, group = np.unique(idx, return_inverse=True)
        means, precs = laplace_update_grouped(
            X,
            r,
            group.astype(np.int64),
            self._means[touched],
            self._precs[touched],
            1.0 / self.prior_var,
            self.discount,
        )
        self._means[touched] = means
        self._precs[touched] = precs

    def _get_data(self) -> dict[str, Any]:
        return {"means": self._means, "precisions": self._precs}

    def _set_data(self, data: dict[str, Any]) -> None:
        shape = (self.n_arms, int(self._dim or 0))
        means = check_array_field(data, "means", shape)
        precs = check_array_field(data, "precisions", shape)
        if (precs <= 0).any():
            raise ValueError("precisions must be > 0")
        self._means, self._precs = means, precs

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"dim": 4}
        yield {"dim": 3, "prior_var": 4.0, "discount": 0.9}
