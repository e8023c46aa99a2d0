"""Online learners for adaptive-spec: bandit policies and contextual acceptance models.

Engine-agnostic: this package imports only numpy and scipy.
"""

from .logistic_ts import LogisticThompson

__all__ = ["LogisticThompson"]
