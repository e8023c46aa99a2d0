"""Regret of a replayed policy against a comparator's goodput.

All policies emit the same tokens, so a comparator with goodput ``G_c`` would have emitted
``G_c * T(s)`` tokens in the time ``T(s)`` the policy used up to step ``s``. The cumulative regret in
tokens is ``R(s) = G_c * T(s) - N(s)`` (``N(s)``: tokens the policy committed by step ``s``); at the
end, ``R = N (G_c / G - 1)``. Comparators (:mod:`adaptive_spec.sim.compare`): the best static arm in
hindsight, the per-request best static arm, and the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .replay import ReplayResult


@dataclass(frozen=True, slots=True)
class Regret:
    """Regret against one comparator: ``tokens`` lost (may be negative when the policy beats it) and
    ``gap`` = ``1 - G / G_c`` (a fraction of the comparator's goodput)."""

    comparator: str
    comparator_goodput: float
    tokens: float
    gap: float


def regret(result: ReplayResult, comparator: str, comparator_goodput: float) -> Regret:
    """Final regret of ``result`` against a comparator goodput (tokens/s).

    Raises
    ------
    ValueError
        For a comparator goodput that is not finite and positive.
    """
    if not (np.isfinite(comparator_goodput) and comparator_goodput > 0):
        raise ValueError(f"comparator_goodput={comparator_goodput!r}; allowed: a finite number > 0")
    tokens = comparator_goodput * result.time_s - result.tokens
    return Regret(comparator, comparator_goodput, tokens, 1.0 - result.goodput / comparator_goodput)


def regret_curve(result: ReplayResult, comparator: float | ReplayResult) -> np.ndarray:
    """Cumulative regret in tokens after each step (float64 [steps]).

    With a goodput ``G_c`` (float): ``G_c * T(s) - N(s)``. With the comparator's own replay (e.g. the
    oracle's), against its trajectory: ``G_c * (T(s) - T_c(N(s)))``, where ``T_c(N)`` is the time the
    comparator took to commit ``N`` tokens (interpolated between its steps); the comparator's own curve
    is then 0, and every curve ends at the same value as with the rate.
    """
    T = np.cumsum(result.step_time_s)
    N = np.cumsum(result.step_tokens)
    if isinstance(comparator, ReplayResult):
        g = comparator.goodput
        Tc = np.concatenate([[0.0], np.cumsum(comparator.step_time_s)])
        Nc = np.concatenate([[0.0], np.cumsum(comparator.step_tokens).astype(float)])
        return g * (T - np.interp(N, Nc, Tc))
    return float(comparator) * T - N
