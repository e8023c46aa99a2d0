"""UCB1 (Auer, Cesa-Bianchi & Fischer 2002) and the index it shares with sliding-window UCB."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float
from .base import ArmId, Policy
from .stats import ArmSums, WindowSums

__all__ = ["UCB1", "ucb_index"]


def ucb_index(stats: ArmSums | WindowSums, width: float) -> np.ndarray:
    """The upper confidence bound ``S_i / N_i + width sqrt(ln T / N_i)`` of every arm, ``[K]``.

    ``N_i`` and ``S_i`` are the (weighted) count and reward sum of arm i in ``stats`` and
    ``T = max(sum_i N_i, 1)``; an arm with ``N_i = 0`` gets +inf (it is tried first). UCB1 takes
    ``width = c sqrt(2)`` on all observations; SW-UCB ``sqrt(xi)`` on the window's (where T is
    ``min(t, window)``).
    """
    counts = stats.counts
    log_t = math.log(max(float(counts.sum()), 1.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        index = stats.sums / counts + width * np.sqrt(log_t / counts)
    return np.where(counts > 0, index, np.inf)


class _IndexUCB(Policy):
    """A UCB policy over one statistic object ``stats`` and a bonus ``width`` (see :func:`ucb_index`)."""

    requires_bounded_rewards = True
    _stats = ("stats",)
    stats: ArmSums | WindowSums
    width: float

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        return ucb_index(self.stats, self.width)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        self.stats.learn(idx, r)


class UCB1(_IndexUCB):
    """UCB1: pull the arm with the largest upper confidence bound on its mean reward.

    Index of arm i after t observations in total, n_i of them on arm i, mean reward mu_i
    (rewards rescaled to [0, 1] from ``reward_range``):
    ``mu_i + c * sqrt(2 ln t / n_i)``; an arm never observed has index +inf, so each arm is
    tried once first. Ties are broken uniformly at random. With ``c = 1`` this is Auer et al.'s
    UCB1, whose expected regret after T rounds is at most
    ``sum_{i: gap_i > 0} 8 ln T / gap_i + (1 + pi^2 / 3) sum_i gap_i``, and the same rule as
    river's ``bandit.UCB(delta=1)``.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    c : float, default 1.0
        Scale of the exploration bonus, > 0.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards; the analysis assumes rewards inside them.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] P. Auer, N. Cesa-Bianchi and P. Fischer, "Finite-time Analysis of the Multiarmed
       Bandit Problem", Machine Learning 47, 2002 (Theorem 1).

    Examples
    --------
    >>> policy = UCB1(["ngram", "draft"], seed=0)
    >>> first = policy.pull()
    >>> policy.update(first, 1.0)
    >>> second = policy.pull()  # the arm not tried yet has an infinite index
    >>> second != first
    True
    """

    name = "ucb1"

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        c: float = 1.0,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.c = check_positive_float("c", c)
        self.width = self.c * math.sqrt(2.0)
        self.stats = ArmSums(self.n_arms)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {}
        yield {"c": 0.5, "reward_range": (-1.0, 2.0)}
