"""Online learners for adaptive-spec: bandit policies and a contextual acceptance model.

Engine-agnostic: this package imports only numpy and scipy, and nothing else of the project.
Every policy shares one interface (:class:`Policy`): ``pull`` / ``pull_batch``, ``update`` /
``update_batch`` / ``update_full``, ``probabilities``, ``state_dict`` / ``load_state_dict``; build
one by name with :func:`make_policy`. The learners compose the statistic objects of
:mod:`~adaptive_spec.bandits.stats` (one Beta posterior, one discounted / windowed counter, one
exponential-weights bookkeeping, one per-arm ridge regression). :class:`LogisticThompson` is an
online Bayesian logistic regression for per-position acceptance.

They play speculative decoding through :class:`adaptive_spec.core.bandit_policy.BanditPolicy`
(policy names ``bandit:<name>``), which is how ``docs/bandits.md`` measures them against the
adaptive controller, the static arms and the oracle.
"""

from .base import ArmId, Policy
from .discounted_thompson import DiscountedThompson
from .epsilon_greedy import EpsilonGreedy
from .exp3 import Exp3
from .hedge import Hedge
from .kl_ucb import KLUCB
from .linucb import LinUCB
from .linucb_hybrid import LinUCBHybrid
from .logistic_ts import LogisticThompson
from .logistic_ts_policy import LogisticThompsonPolicy
from .registry import POLICIES, available_policies, make_policy, policy_class
from .sw_ucb import SlidingWindowUCB
from .thompson_beta import ThompsonBeta
from .thompson_gaussian import ThompsonGaussian
from .ucb1 import UCB1
from .ucb_tuned import UCBTuned

__all__ = [
    "KLUCB",
    "POLICIES",
    "UCB1",
    "ArmId",
    "DiscountedThompson",
    "EpsilonGreedy",
    "Exp3",
    "Hedge",
    "LinUCB",
    "LinUCBHybrid",
    "LogisticThompson",
    "LogisticThompsonPolicy",
    "Policy",
    "SlidingWindowUCB",
    "ThompsonBeta",
    "ThompsonGaussian",
    "UCBTuned",
    "available_policies",
    "make_policy",
    "policy_class",
]
