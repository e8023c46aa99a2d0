"""The adaptive controller's parameters: their ranges (:class:`~.adaptive.AdaptiveController`
documents their meaning)."""

from __future__ import annotations

import math

import numpy as np

EXPLORATION_MODES = ("greedy", "ucb", "thompson", "eps-greedy")


def check_parameters(
    *,
    max_k: int,
    exploration: str,
    epsilon: float,
    ucb_bonus: float,
    discount: float,
    ema: float,
    counts: dict[str, int],
    speculation_premium: float,
    drain_margin: int | str | None,
    seed: int,
) -> int | None:
    """Check the controller's parameters (``counts``: the integer ones >= 1 by name: probe_every,
    shadow_every, rest_after, wake_every). Returns the drain margin, ``"auto"`` resolved to
    ``2 * (max_k + 1)``.

    Raises
    ------
    ValueError
        Naming the first parameter outside its range.
    """
    if max_k < 1:
        raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 1")
    if exploration not in EXPLORATION_MODES:
        raise ValueError(
            f"exploration={exploration!r} is not known; allowed: {', '.join(EXPLORATION_MODES)}"
        )
    if not (isinstance(epsilon, int | float) and 0.0 <= epsilon <= 1.0):
        raise ValueError(f"epsilon={epsilon!r} is invalid; allowed: 0 <= epsilon <= 1")
    for name, v in (("ema", ema), ("discount", discount)):
        if not (isinstance(v, int | float) and 0.0 < v <= 1.0):
            raise ValueError(f"{name}={v!r} is invalid; allowed: 0 < {name} <= 1")
    if not (isinstance(ucb_bonus, int | float) and math.isfinite(ucb_bonus) and ucb_bonus >= 0):
        raise ValueError(f"ucb_bonus={ucb_bonus!r} is invalid; allowed: a finite number >= 0")
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid; allowed: an integer >= 1")
    if not (
        isinstance(speculation_premium, int | float)
        and not isinstance(speculation_premium, bool)
        and math.isfinite(speculation_premium)
        and speculation_premium >= 0
    ):
        raise ValueError(
            f"speculation_premium={speculation_premium!r} is invalid; allowed: a finite "
            "number >= 0 (0: price speculation at the cost table's time)"
        )
    if drain_margin == "auto":
        drain_margin = 2 * (max_k + 1)
    elif drain_margin is not None and (
        isinstance(drain_margin, bool) or not isinstance(drain_margin, int) or drain_margin < 0
    ):
        raise ValueError(
            f"drain_margin={drain_margin!r} is invalid; allowed: an integer >= 0, 'auto' (two "
            "steps' worth of tokens, 2 * (max_k + 1)) or None (per-step goodput also while the "
            "batch drains)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid; allowed: an integer >= 0")
    return drain_margin
