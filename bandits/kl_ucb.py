"""KL-UCB for bounded rewards (Garivier & Cappé 2011)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from scipy.special import rel_entr

from ._validation import check_positive_float
from .base import ArmId, Policy
from .stats import ArmSums

__all__ = ["KLUCB", "bernoulli_kl", "kl_upper_bound"]

_NEWTON_STEPS = 40
_TOL = 1e-13  # nats
_STEP_TOL = 1e-11
_Q_MAX = 1.0 - 1e-12


def bernoulli_kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Kullback-Leibler divergence ``KL(Bernoulli(p) || Bernoulli(q))`` in nats, elementwise."""
    return rel_entr(p, q) + rel_entr(1.0 - p, 1.0 - q)


def kl_upper_bound(mean: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """Largest ``q`` in ``[mean, 1]`` with ``KL(mean || q) <= budget``, by Newton's method.

    Solved in ``u = -ln(1 - q)``, where ``f(u) = KL(mean || q(u)) - budget`` is convex and
    increasing on ``q >= mean`` with no boundary at q = 1 (f grows linearly in u there), so
    Newton's iterates converge monotonically from the right of the root, and one step from the
    left lands right of it. The start is the root of the local quadratic approximation
    ``(q - mean)^2 / (2 mean (1 - mean))``, capped by Pinsker's bound ``mean + sqrt(budget/2)``.

    Parameters
    ----------
    mean : numpy.ndarray of float, values in [0, 1]
        Empirical means.
    budget : numpy.ndarray of float, >= 0, broadcastable to ``mean``
        Allowed divergence per arm, ``(ln t + c ln ln t) / n_i``.

    Returns
    -------
    numpy.ndarray of float64
        The upper confidence bounds, to about 1e-10 (at most ``1 - 1e-12``; exactly 1 where
        the mean is 1).
    """
    p = np.clip(np.asarray(mean, dtype=np.float64), 0.0, 1.0)
    b = np.broadcast_to(np.asarray(budget, dtype=np.float64), p.shape)
    start = np.minimum(p + np.sqrt(2.0 * b * p * (1.0 - p)), p + np.sqrt(b / 2.0))
    q = np.clip(start, p, _Q_MAX)
    u_min, u_max = -np.log1p(-np.minimum(p, _Q_MAX)), -np.log1p(-_Q_MAX)
    u = -np.log1p(-q)
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(_NEWTON_STEPS):
            f = bernoulli_kl(p, q) - b
            # df/du = (q - p) / q; at q = p (f <= 0 there) step right by the local quadratic.
            step = np.where(q > p, f * q / (q - p), -np.inf)
            step = np.where((np.abs(f) <= _TOL) | ((f < 0) & (q >= _Q_MAX)), 0.0, step)
            if not np.any((1.0 - q) * np.abs(step) > _STEP_TOL):  # change in q, not u
                break
            u = np.clip(np.where(np.isfinite(step), u - step, u + 1.0), u_min, u_max)
            q = np.maximum(-np.expm1(-u), p)
    return np.where(p >= 1.0, 1.0, q)


class KLUCB(Policy):
    """KL-UCB: the upper confidence bound from the Bernoulli Kullback-Leibler divergence.

    Index of arm i after t observations, n_i on arm i, with empirical mean mu_i of its rewards
    (rescaled to [0, 1]): ``max{q in [mu_i, 1] : n_i KL(mu_i || q) <= ln t + c ln ln t}``.
    Arms never observed come first (index +inf); ties are broken uniformly at random. For
    Bernoulli rewards it is asymptotically optimal (matches Lai & Robbins' lower bound); for
    any rewards in [0, 1] its regret is at most that for Bernoulli arms of the same means.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    c : float, default 0.0
        Weight of the ``ln ln t`` term; the analysis takes c = 3, the paper's experiments c = 0.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] A. Garivier and O. Cappé, "The KL-UCB Algorithm for Bounded Stochastic Bandits and
       Beyond", COLT 2011.
    """

    name = "kl-ucb"
    requires_bounded_rewards = True
    _stats = ("stats",)

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        c: float = 0.0,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.c = check_positive_float("c", c, allow_zero=True)
        self.stats = ArmSums(self.n_arms)

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        counts = self.stats.counts
        t = max(int(counts.sum()), 1)
        explore = np.log(t) + (self.c * np.log(np.log(t)) if t > np.e else 0.0)
        seen = counts > 0
        out = np.full(self.n_arms, np.inf)
        if seen.any():
            mean = np.clip(self.stats.sums[seen] / counts[seen], 0.0, 1.0)
            out[seen] = kl_upper_bound(mean, max(explore, 0.0) / counts[seen])
        return out

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.learn(idx, r)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"c": 3.0}
