"""Sliding-window UCB (Garivier & Moulines 2011)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._validation import check_positive_float, check_positive_int
from .base import ArmId, Policy

__all__ = ["SlidingWindowUCB"]


class SlidingWindowUCB(Policy):
    """SW-UCB: UCB on the last ``window`` observations only, for abruptly changing rewards.

    With ``N_i`` and ``mu_i`` the number and mean of arm i's rewards (rescaled to [0, 1]) among
    the last ``window`` observations and t the number of observations so far, the index is
    ``mu_i + sqrt(xi ln(min(t, window)) / N_i)`` (+inf when ``N_i = 0``, so an arm that fell
    out of the window is tried again). After a change, the old rewards leave the window within
    ``window`` observations. Garivier & Moulines take ``window ~ 2 sqrt(T ln T / Upsilon)`` for
    Upsilon change points in T rounds, giving regret ``O(sqrt(Upsilon T ln T))``.

    The window counts observations (a batch of n updates advances it by n; a full-information
    round by K). Windowed sums are maintained incrementally and recomputed exactly from the
    buffer every time it wraps, so rounding never accumulates.

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
    requires_bounded_rewards = True

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
        self._buf_arm = np.full(self.window, -1, dtype=np.int64)
        self._buf_reward = np.zeros(self.window)
        self._pos = 0
        self._recount()

    def _recount(self) -> None:
        valid = self._buf_arm >= 0
        arms = self._buf_arm[valid]
        self._win_counts = np.bincount(arms, minlength=self.n_arms).astype(np.int64)
        self._win_sums = np.bincount(
            arms, weights=self._buf_reward[valid], minlength=self.n_arms
        ).astype(np.float64)

    def _scores(self, X: np.ndarray | None, n: int) -> np.ndarray:
        counts = self._win_counts
        horizon = max(min(self.n_updates, self.window), 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            index = self._win_sums / counts + np.sqrt(self.xi * np.log(horizon) / counts)
        return np.where(counts > 0, index, np.inf)

    def _learn(self, idx: np.ndarray, r: np.ndarray, X: np.ndarray | None) -> None:
        n, w = idx.shape[0], self.window
        if n >= w:  # the batch fills the whole window; keep the ring layout of n single updates
            slots = (self._pos + np.arange(n - w, n)) % w
            self._buf_arm[slots] = idx[-w:]
            self._buf_reward[slots] = r[-w:]
            self._pos = (self._pos + n) % w
            self._recount()
            return
        slots = (self._pos + np.arange(n)) % w
        old = self._buf_arm[slots]
        keep = old >= 0
        self._win_counts -= np.bincount(old[keep], minlength=self.n_arms)
        self._win_sums -= np.bincount(
            old[keep], weights=self._buf_reward[slots][keep], minlength=self.n_arms
        )
        self._buf_arm[slots] = idx
        self._buf_reward[slots] = r
        self._win_counts += np.bincount(idx, minlength=self.n_arms)
        self._win_sums += np.bincount(idx, weights=r, minlength=self.n_arms)
        wrapped = self._pos + n >= w
        self._pos = (self._pos + n) % w
        if wrapped:
            self._recount()

    def _params(self) -> dict[str, Any]:
        return {
            **self._base_params(),
            "window": self.window,
            "xi": self.xi,
            "reward_range": self._reward_range,
        }

    def _get_data(self) -> dict[str, Any]:
        return {
            "buf_arm": self._buf_arm,
            "buf_reward": self._buf_reward,
            "pos": self._pos,
            "win_sums": self._win_sums,
        }

    def _set_data(self, data: dict[str, Any]) -> None:
        buf_arm = np.asarray(data["buf_arm"])
        buf_reward = np.asarray(data["buf_reward"], dtype=np.float64)
        if buf_arm.shape != (self.window,) or buf_reward.shape != (self.window,):
            raise ValueError(f"buffers must have {self.window} entries")
        if buf_arm.dtype.kind != "i" or (buf_arm < -1).any() or (buf_arm >= self.n_arms).any():
            raise ValueError("buf_arm must hold arm indices or -1")
        if not np.isfinite(buf_reward).all():
            raise ValueError("buf_reward must be finite")
        pos = data["pos"]
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < self.window:
            raise ValueError(f"pos must be an int in [0, {self.window}), got {pos!r}")
        self._buf_arm = buf_arm.astype(np.int64)
        self._buf_reward = buf_reward
        self._pos = pos
        self._recount()
        # The incrementally maintained sums may differ from a recount in the last bits.
        win_sums = np.asarray(data["win_sums"], dtype=np.float64)
        if win_sums.shape != (self.n_arms,) or not np.isfinite(win_sums).all():
            raise ValueError(f"win_sums must be {self.n_arms} finite floats")
        self._win_sums = win_sums

    @classmethod
    def _unit_test_params(cls) -> Iterator[dict[str, Any]]:
        yield {"window": 50}
        yield {"window": 7, "xi": 2.0}
