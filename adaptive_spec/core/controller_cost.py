"""The controller's own time per step, against a static arm's, for the safety rule's baseline.

The engine's measured step time contains the controller's time (the adapter's hooks, the step
driver, the proposers' drafting and the policy's ``decide`` and ``observe``;
:class:`~adaptive_spec.core.protocol.StepOutcome`'s ``controller_time_s``). A static arm run by the
same step driver pays the hooks, the driver's bookkeeping and its own proposer's drafting too; only
the adaptive controller pays its decision and observation and the other proposers' drafting. So the
baseline's counterfactual step is charged a static arm's controller time, not the adaptive one's::

    static_s  = controller_time_s - policy_time_s - (other proposers' time) + static_decide_s(B)
    base_time = (measured step) - ... - (controller_time_s - static_s)

``policy_time_s`` and the proposers' times are measured by the step driver on the step itself;
``static_decide_s(B)`` is measured here, on this machine: the baseline's own policy
(:class:`~adaptive_spec.core.baselines.BatchSizeTablePolicy`, or ``none``) decides on the controller's
real views, on the first ``warm`` decisions of each batch-size bucket (powers of two) and then one in
``every``, and a moving average of its time is kept per bucket (a static policy's ``observe`` is the
base class's no-op). Where the step time holds no controller time (``controller_time_s = 0``: replay's
simulated clock) nothing is charged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from adaptive_spec.core.arms import NO_SPEC
from adaptive_spec.core.baselines import BaselineRule, BatchSizeTablePolicy, StaticPolicy
from adaptive_spec.core.protocol import SpecPolicy, StepOutcome, StepView

#: Batch-size buckets: bucket b holds batch sizes 2**b .. 2**(b+1) - 1 (the last one all beyond).
N_BUCKETS = 12


def _bucket(batch_size: int) -> int:
    return min(max(int(batch_size), 1).bit_length() - 1, N_BUCKETS - 1)


def _seconds(x: float) -> float:
    """``x`` when it is a finite time >= 0, else 0 (no NaN or negative reaches the safety rule)."""
    return float(x) if math.isfinite(x) and x > 0.0 else 0.0


def static_policy(rule: BaselineRule, max_k: int) -> SpecPolicy:
    """The policy a static arm runs for ``rule``: its batch-size table, or ``none``."""
    if rule.proposer is None:
        return StaticPolicy([], max_k, NO_SPEC)
    rows = [[s, e, min(k, max_k)] for s, e, k in rule.table]
    return BatchSizeTablePolicy([rule.proposer], max_k, rule.proposer, rows)


class ControllerCost:
    """What a step's controller time would have been under a static arm (module docstring).

    Parameters
    ----------
    rule : BaselineRule
        The safety rule's baseline (its proposer's drafting is a static arm's too).
    max_k : int >= 0
    every : int >= 1
        After ``warm`` timed decisions in a batch-size bucket, one decision in ``every`` there is
        timed.
    warm : int >= 1
    weight : float in (0, 1]
        Weight of the newest timing in a bucket's moving average.
    clock : callable returning seconds
        The clock the static policy's decision is timed with (``time.perf_counter``).

    Raises
    ------
    ValueError
        For ``every``, ``warm`` or ``weight`` out of range.
    """

    def __init__(
        self,
        rule: BaselineRule,
        max_k: int,
        *,
        every: int = 64,
        warm: int = 4,
        weight: float = 0.2,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not (isinstance(every, int) and every >= 1 and isinstance(warm, int) and warm >= 1):
            raise ValueError(f"every={every!r}, warm={warm!r} are invalid; allowed: integers >= 1")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight={weight!r} is invalid; allowed: 0 < weight <= 1")
        self.policy = static_policy(rule, max_k)
        self.proposer = rule.proposer
        self.every, self.warm, self.weight = every, warm, float(weight)
        self.clock = clock
        self.decide_s = [0.0] * N_BUCKETS  # per bucket: the static policy's decision (s), averaged
        self.timed = [0] * N_BUCKETS  # per bucket: decisions timed
        self.seen = [0] * N_BUCKETS  # per bucket: decisions seen
        # Over the charged steps (s): the measured controller time, a static arm's, and the steps.
        self.controller_s = 0.0
        self.static_s = 0.0
        self.steps = 0

    def time_static(self, view: StepView) -> None:
        """Time the static policy's decision on ``view`` when this bucket's schedule says so."""
        b = _bucket(view.batch_size)
        n = self.seen[b]
        self.seen[b] = n + 1
        if n >= self.warm and n % self.every:
            return
        clock = self.clock
        t0 = clock()
        self.policy.decide(view)
        dt = _seconds(clock() - t0)
        w = 1.0 if self.timed[b] == 0 else self.weight
        self.decide_s[b] += w * (dt - self.decide_s[b])
        self.timed[b] += 1

    def static_decide_s(self, batch_size: int) -> float:
        """The static policy's decision at ``batch_size`` (s): its bucket's average, else the nearest
        timed bucket's (0 before any)."""
        b = _bucket(batch_size)
        if self.timed[b]:
            return self.decide_s[b]
        timed = [i for i in range(N_BUCKETS) if self.timed[i]]
        if not timed:
            return 0.0
        return self.decide_s[min(timed, key=lambda i: (abs(i - b), i))]

    def charge(self, outcome: StepOutcome, batch_size: int) -> float:
        """The seconds of this step's controller time that a static arm would not have spent (its
        ``controller_time_s`` less a static arm's; negative where the static arm's is larger). 0
        when the step time holds no controller time. Always finite and at most ``controller_time_s``
        (itself taken as at most ``step_time_s``)."""
        ctrl = min(_seconds(outcome.controller_time_s), _seconds(outcome.step_time_s))
        if ctrl == 0.0:
            return 0.0
        own = _seconds(outcome.policy_time_s)
        for p, s in outcome.proposer_time_s.items():
            if p != self.proposer:
                own += _seconds(s)
        static = max(ctrl - own + self.static_decide_s(batch_size), 0.0)
        self.controller_s += ctrl
        self.static_s += static
        self.steps += 1
        return ctrl - static

    def as_dict(self) -> dict[str, Any]:
        """Per charged step, in ms: the measured controller time, a static arm's and their difference
        (charged to the baseline's counterfactual); the static policy's decision per timed bucket
        (µs, keyed by the bucket's smallest batch size)."""
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "controller_ms": round(1e3 * self.controller_s / n, 4),
            "static_ms": round(1e3 * self.static_s / n, 4),
            "charged_ms": round(1e3 * (self.controller_s - self.static_s) / n, 4),
            "static_decide_us": {
                str(1 << b): round(1e6 * self.decide_s[b], 2)
                for b in range(N_BUCKETS)
                if self.timed[b]
            },
        }
