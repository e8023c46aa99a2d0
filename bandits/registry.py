"""Policy registry: build any policy by name with :func:`make_policy`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import ArmId, Policy
from .discounted_thompson import DiscountedThompson
from .epsilon_greedy import EpsilonGreedy
from .exp3 import Exp3
from .hedge import Hedge
from .kl_ucb import KLUCB
from .linucb import LinUCB
from .linucb_hybrid import LinUCBHybrid
from .logistic_ts_policy import LogisticThompsonPolicy
from .sw_ucb import SlidingWindowUCB
from .thompson_beta import ThompsonBeta
from .thompson_gaussian import ThompsonGaussian
from .ucb1 import UCB1
from .ucb_tuned import UCBTuned

__all__ = ["POLICIES", "available_policies", "make_policy", "policy_class"]

#: Registry name -> policy class.
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        UCB1,
        UCBTuned,
        KLUCB,
        Exp3,
        EpsilonGreedy,
        ThompsonBeta,
        ThompsonGaussian,
        LinUCB,
        LinUCBHybrid,
        LogisticThompsonPolicy,
        Hedge,
        SlidingWindowUCB,
        DiscountedThompson,
    )
}


def available_policies() -> list[str]:
    """Sorted registry names."""
    return sorted(POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name``.

    Raises
    ------
    ValueError
        If ``name`` is not registered; the message lists the allowed names.
    """
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {name!r}; allowed: {', '.join(available_policies())}"
        ) from None


def make_policy(name: str, arms: Sequence[ArmId], **kwargs: Any) -> Policy:
    """Build the policy registered as ``name`` over ``arms``.

    Parameters
    ----------
    name : str
        One of :func:`available_policies`: ``"ucb1"``, ``"ucb-tuned"``, ``"kl-ucb"``,
        ``"exp3"``, ``"epsilon-greedy"``, ``"thompson-beta"``, ``"thompson-gaussian"``,
        ``"linucb"``, ``"linucb-hybrid"``, ``"logistic-ts"``, ``"hedge"``, ``"sw-ucb"``,
        ``"discounted-thompson"``.
    arms : sequence of str or int
        Distinct arm ids.
    **kwargs
        The policy's keyword arguments (``seed``, and ``dim`` for contextual policies).

    Returns
    -------
    Policy

    Raises
    ------
    ValueError
        On an unknown name (listing the allowed ones) or invalid arguments.
    TypeError
        On a keyword argument the policy does not take.

    Examples
    --------
    >>> policy = make_policy("linucb", ["none", "ngram-k4", "draft-k2"], dim=3, seed=0)
    >>> policy.pull([1.0, 0.2, 0.5]) in policy.arms
    True
    """
    return policy_class(name)(arms, **kwargs)
