"""The oracle: hindsight-optimal arms from the counterfactual drafts, and an upper bound on goodput.

Every policy emits the same tokens (greedy decoding), so maximising goodput is minimising total step
time. With a linear lower bound ``t >= c0 + cb B + cv V + cd D + cp P`` on the cost profile (a
*minorant*, non-negative coefficients, :meth:`CostProfile.minorants`) and at most ``Bmax`` requests per
step, any schedule's total time is at least

    sum over request-steps of  (c0 / Bmax + cb) + cv k + (cd / Bmax) k [draft model]
  + sum over requests of       cp * prompt length

because the number of steps is at least request-steps / Bmax and a step's draft passes are at least
the mean k of its draft-model requests. The right side separates per request, so a shortest path over
each request's output positions (node n = tokens committed; edge = an arm, from n to n + accepted + 1)
minimises it exactly: :func:`plan_request`. Hence

* :func:`oracle_bound`: committed tokens / that minimum is >= every policy's goodput on the workload
  (a bound, not a schedule; with ``Bmax = 1`` the step cost is the profile's exact cost of the
  request's own arm, and the bound is attained);
* :class:`OraclePolicy`: plays each request's shortest-path arm at its current position, a
  per-step oracle that is exactly optimal at concurrency 1 and near the bound when batches stay full;
* :class:`PerRequestStaticPolicy`: the best *static* arm per request in hindsight (same per-request
  cost), the comparator for "per-request best static arm" regret.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from adaptive_spec.core.arms import NO_SPEC, Arm, arm_space
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepView

from .cost_profiles import CostProfile, LinearCoefficients, is_draft_model
from .requests import ReplayRequest

WeightFn = Callable[[str, int], float]


@dataclass(frozen=True, slots=True)
class StepWeights:
    """Per-request cost of one request-step: ``arm(proposer, k)`` and prefill of ``P`` prompt tokens."""

    arm: WeightFn
    prefill: Callable[[int], float]


def linear_weights(coef: LinearCoefficients, max_batch: int) -> StepWeights:
    """Per-request attribution of a linear (minorant) cost with at most ``max_batch`` per step."""
    a = coef.c0 / max_batch + coef.c_batch

    def arm(p: str, k: int) -> float:
        w = a + coef.c_token * k
        if k and is_draft_model(p):
            w += coef.c_draft_pass * k / max_batch
        return w

    return StepWeights(arm, lambda P: a + coef.c_prefill_token * P)


def exact_weights(profile: CostProfile) -> StepWeights:
    """The profile's exact step cost at batch size 1."""

    def arm(p: str, k: int) -> float:
        return float(profile.step_time(1, k, k if (k and is_draft_model(p)) else 0, 0))

    return StepWeights(arm, lambda P: float(profile.step_time(1, 0, 0, P)))


def plan_request(
    req: ReplayRequest, proposers: list[str], max_k: int, weights: StepWeights
) -> tuple[float, list[Arm]]:
    """Shortest path over a request's output positions.

    Parameters
    ----------
    req : ReplayRequest
    proposers : list of str
        Proposers the plan may use (their counterfactual drafts, cut to ``max_k``).
    max_k : int
        Largest k.
    weights : StepWeights
        Cost of each arm's request-step and of the prefill.

    Returns
    -------
    (cost, plan)
        Minimum total cost (prefill included, seconds) and the arm to play at each position
        ``0..L-1`` (position 0 is the prefill: ``none``).
    """
    L = len(req)
    f = np.zeros(L + 1)
    plan: list[Arm] = [NO_SPEC] * L
    w_none = weights.arm("none", 0)
    wk = {p: np.array([weights.arm(p, k) for k in range(1, max_k + 1)]) for p in proposers}
    for n in range(L - 1, 0, -1):
        best = w_none + f[n + 1]
        choice = NO_SPEC
        for p in proposers:
            d = req.draft(p, n)
            if d is None or d.size == 0 or max_k == 0:
                continue
            avail = min(int(d.size), max_k)
            m = req.match_length(p, n)
            ks = np.arange(1, avail + 1)
            nxt = np.minimum(n + np.minimum(ks, m) + 1, L)
            cost = wk[p][:avail] + f[nxt]
            j = int(np.argmin(cost))
            if cost[j] < best - 1e-15:
                best = float(cost[j])
                choice = Arm(p, int(ks[j]))
        f[n] = best
        plan[n] = choice
    total = weights.prefill(req.prefill_len) + (f[1] if L > 1 else 0.0)
    return float(total), plan


def _weights_for(
    profile: CostProfile, max_batch: int, coef: LinearCoefficients | None
) -> StepWeights:
    if max_batch == 1:
        return exact_weights(profile)
    assert coef is not None
    return linear_weights(coef, max_batch)


def _check_max_batch(max_batch: int) -> None:
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} is invalid; allowed: an integer >= 1")


@dataclass(frozen=True, slots=True)
class OracleBound:
    """Upper bound on goodput: ``tokens / time_s`` (seconds are a lower bound on total step time)."""

    tokens: int
    time_s: float

    @property
    def goodput(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else float("inf")


def oracle_bound(
    requests: list[ReplayRequest],
    profile: CostProfile,
    *,
    max_batch: int,
    proposers: list[str],
    max_k: int,
) -> OracleBound:
    """The goodput no policy can exceed on ``requests`` (see the module docstring); the largest time
    bound over the profile's minorants."""
    _check_max_batch(max_batch)
    props = [p for p in proposers if p != "none"]
    tokens = sum(len(r) for r in requests)
    coefs: list[LinearCoefficients | None] = [None] if max_batch == 1 else list(profile.minorants())
    best = 0.0
    for coef in coefs:
        w = _weights_for(profile, max_batch, coef)
        best = max(best, sum(plan_request(r, props, max_k, w)[0] for r in requests))
    return OracleBound(tokens, best)


class HindsightPolicy(SpecPolicy):
    """A policy planned in hindsight from a workload's outputs and counterfactual drafts, with the
    per-request cost of :func:`plan_request`.

    Parameters
    ----------
    proposers : list of str
    max_k : int
    requests : list of ReplayRequest
        The workload it will be replayed on (the policy knows every output).
    profile : CostProfile
    max_batch : int >= 1
        The replay's largest batch; with 1 the plan uses the exact step cost, else the profile
        linearised at a full batch drafting ``max_k / 2`` tokens per request.

    Raises
    ------
    ValueError
        For an invalid ``max_batch`` (and as :class:`~adaptive_spec.core.protocol.SpecPolicy`).
    """

    def __init__(
        self,
        proposers: list[str],
        max_k: int,
        *,
        requests: list[ReplayRequest],
        profile: CostProfile,
        max_batch: int,
    ) -> None:
        super().__init__(proposers, max_k)
        _check_max_batch(max_batch)
        coef = profile.linearize(max_batch, max_batch * max_k / 2) if max_batch > 1 else None
        self._plan(requests, _weights_for(profile, max_batch, coef))

    @abstractmethod
    def _plan(self, requests: list[ReplayRequest], weights: StepWeights) -> None:
        """Plan every request of the workload with per-request-step costs ``weights``."""


class OraclePolicy(HindsightPolicy):
    """Plays each request's hindsight shortest-path arm (see the module docstring); parameters as
    :class:`HindsightPolicy`."""

    name = "oracle"

    def _plan(self, requests: list[ReplayRequest], weights: StepWeights) -> None:
        self._plans = {
            r.req_id: plan_request(r, self.proposers, self.max_k, weights)[1] for r in requests
        }

    def decide(self, view: StepView) -> Decision:
        arms = []
        for r in view.requests:
            plan = self._plans.get(r.req_id)
            arm = (
                plan[r.num_output_tokens]
                if plan is not None and r.num_output_tokens < len(plan)
                else NO_SPEC
            )
            d = r.drafts.get(arm.proposer)
            if arm.k and (d is None or d.size < arm.k):
                arm = NO_SPEC
            arms.append(arm)
        return Decision(arms, [1.0] * len(arms), [[] for _ in arms])


def static_request_cost(req: ReplayRequest, arm: Arm, max_k: int, weights: StepWeights) -> float:
    """Per-request cost (``weights``) of playing ``arm`` at every step, cut to the draft offered and
    to the budget as :class:`~adaptive_spec.core.baselines.StaticPolicy` does."""
    L = len(req)
    total = weights.prefill(req.prefill_len)
    n = 1
    while n < L:
        k = 0
        if arm.k:
            d = req.draft(arm.proposer, n)
            avail = 0 if d is None else min(int(d.size), max_k, req.max_tokens - n - 1)
            k = min(arm.k, max(avail, 0))
        if k == 0:
            total += weights.arm("none", 0)
            n += 1
        else:
            total += weights.arm(arm.proposer, k)
            n += min(min(k, req.match_length(arm.proposer, n)) + 1, L - n)
    return total


class PerRequestStaticPolicy(HindsightPolicy):
    """Each request plays its own best static arm in hindsight (minimum per-request cost, as in
    :class:`OraclePolicy`), cut to the draft offered and the budget like ``StaticPolicy``;
    parameters as :class:`HindsightPolicy`."""

    name = "per-request-static"

    def _plan(self, requests: list[ReplayRequest], weights: StepWeights) -> None:
        arms = arm_space(self.proposers, self.max_k)
        self.best: dict[str, Arm] = {}
        for r in requests:
            costs = [static_request_cost(r, a, self.max_k, weights) for a in arms]
            self.best[r.req_id] = arms[int(np.argmin(costs))]

    def decide(self, view: StepView) -> Decision:
        arms = []
        for r in view.requests:
            arm = self.best.get(r.req_id, NO_SPEC)
            d = r.drafts.get(arm.proposer)
            avail = 0 if d is None else min(int(d.size), r.max_new_tokens - 1)
            k = min(arm.k, max(avail, 0))
            arms.append(NO_SPEC if k == 0 else Arm(arm.proposer, k))
        return Decision(arms, [1.0] * len(arms), [[] for _ in arms])
