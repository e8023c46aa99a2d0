"""Hedge, exponential weights with full information (Freund & Schapire 1997)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float, check_rate_or_horizon
from .base import ArmId, Policy
from .stats import ExpWeights

__all__ = ["Hedge"]


class Hedge(Policy):
    """Hedge: play ``p_i proportional to exp(eta * G_i)``, G_i the cumulative reward of arm i.

    For when every arm's outcome is known after the fact (full information), as for
    deterministic proposers (n-gram, Jacobi) scored counterfactually on the tokens the target
    emitted: learn with :meth:`update_full`; :meth:`update` and :meth:`update_batch` refuse
    bandit feedback. Rewards are rescaled to [0, 1] per round and the cumulative rewards are kept
    re-centred in the log domain (:class:`~adaptive_spec.bandits.stats.ExpWeights`, shared with
    EXP3), so the weights never overflow.

    Learning rate: a fixed ``eta``; or tuned to a horizon T, ``eta = sqrt(8 ln K / T)``
    (regret at most ``sqrt(T ln K / 2)``); or by default the anytime schedule
    ``eta_t = sqrt(8 ln K / t)`` in round t, with regret at most
    ``2 sqrt(T ln K / 2) + sqrt(ln K / 8)`` (Cesa-Bianchi & Lugosi 2006, Theorem 2.3).

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    eta : float, optional
        Fixed learning rate, > 0.
    horizon : int, optional
        Number of rounds T to tune eta for.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed of the arm draws.

    Raises
    ------
    ValueError
        If both ``eta`` and ``horizon`` are given, or either is out of range.

    References
    ----------
    .. [1] Y. Freund and R. E. Schapire, "A Decision-Theoretic Generalization of On-Line
       Learning and an Application to Boosting", JCSS 55(1), 1997.
    .. [2] N. Cesa-Bianchi and G. Lugosi, "Prediction, Learning, and Games", Cambridge
       University Press, 2006, sections 2.2-2.3.

    Examples
    --------
    >>> policy = Hedge(["ngram", "jacobi"], seed=0)
    >>> policy.update_full([1.0, 0.0])  # both proposers scored on the emitted tokens
    >>> p = policy.probabilities()
    >>> bool(p[0] > p[1]) and round(float(p.sum()), 12)
    1.0
    """

    name = "hedge"
    randomized = True
    full_information_only = True
    requires_bounded_rewards = True
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        eta: float | None = None,
        horizon: int | None = None,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.eta, self.horizon = check_rate_or_horizon("eta", eta, horizon, check_positive_float)
        self.stats = ExpWeights(self.n_arms)
        self._rounds = 0

    @property
    def current_eta(self) -> float:
        """Learning rate used by the next decision."""
        if self.eta is not None:
            return self.eta
        log_k = math.log(max(self.n_arms, 2))
        # Round t (1-based) uses eta_t = sqrt(8 ln K / t); t - 1 rounds have been learned.
        return math.sqrt(8.0 * log_k / (self.horizon or self._rounds + 1))

    def _probs(self, X: np.ndarray | None, n: int) -> np.ndarray:
        return self.stats.softmax(self.current_eta)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self._refuse_bandit_feedback()

    def _learn_full(self, R: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.add(R.sum(axis=0))
        self._rounds += R.shape[0]

    def _get_data(self) -> dict[str, Any]:
        return {**super()._get_data(), "rounds": self._rounds}

    def _set_data(self, data: dict[str, Any]) -> None:
        super()._set_data(data)
        rounds = data["rounds"]
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"rounds must be an int >= 0, got {rounds!r}")
        self._rounds = rounds

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"eta": 0.5}
        yield {"horizon": 1000}
