"""Sliding-window UCB (Garivier & Moulines 2011)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from ._validation import check_positive_float, check_positive_int
from .base import ArmId
from .stats import WindowSums
from .ucb1 import _IndexUCB

__all__ = ["SlidingWindowUCB"]


class SlidingWindowUCB(_IndexUCB):
    """SW-UCB: UCB on the last ``window`` observations only, for abruptly changing rewards.

    With ``N_i`` and ``mu_i`` the number and mean of arm i's rewards (rescaled to [0, 1]) among
    the last ``window`` observations and t the number of observations so far, the index is
    ``mu_i + sqrt(xi ln(min(t, window)) / N_i)`` (+inf when ``N_i = 0``, so an arm that fell
    out of the window is tried again). After a change, the old rewards leave the window within
    ``window`` observations. Garivier & Moulines take ``window ~ 2 sqrt(T ln T / Upsilon)`` for
    Upsilon change points in T rounds, giving regret ``O(sqrt(Upsilon T ln T))``.

    The window counts observations (a batch of n updates advances it by n; a full-information
    round by K); its statistics are a :class:`~adaptive_spec.bandits.stats.WindowSums`.

    Parameters
    ----------
    arms : sequence of str or int
        Arm ids.
    window : int, default 1000
        Number of most recent observations kept, >= 1.
    xi : float, default 0.6
        Exploration constant (> 1/2 in the analysis), > 0.
    reward_range : (float, float), default (0, 1)
        Bounds of the rewards.
    seed : int or None
        Seed for tie-breaking.

    References
    ----------
    .. [1] A. Garivier and E. Moulines, "On Upper-Confidence Bound Policies for Switching
       Bandit Problems", ALT 2011 (SW-UCB).
    """

    name = "sw-ucb"

    def __init__(
        self,
        arms: Sequence[ArmId],
        *,
        window: int = 1000,
        xi: float = 0.6,
        reward_range: tuple[float, float] = (0.0, 1.0),
        seed: int | None = None,
    ) -> None:
        super().__init__(arms, seed=seed, reward_range=reward_range)
        self.window = check_positive_int("window", window)
        self.xi = check_positive_float("xi", xi)
        self.width = math.sqrt(self.xi)
        self.stats = WindowSums(self.n_arms, self.window)

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"window": 50}
        yield {"window": 7, "xi": 2.0}
