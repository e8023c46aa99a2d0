"""Offline replay: run any :class:`~adaptive_spec.controller.SpecPolicy` over a recorded workload.

The simulator advances every request along its known output sequence. Per simulated step:

1. admit waiting requests (in the given order, once arrived) until ``max_batch`` run; a newly admitted
   request spends this step in prefill and emits its first output token (no drafts, as in vLLM);
2. build a :class:`~adaptive_spec.controller.StepView` for the decoding requests, with each proposer's
   counterfactual draft at the request's current position, and call ``policy.decide``;
3. per request: cut the chosen proposer's draft to k (an empty draft means no speculation), accepted
   length = common prefix of the draft and the true next tokens, emitted = accepted + 1 (the bonus or
   correction token), truncated at the end of the output;
4. charge the cost profile's step time for (batch size, verified tokens, draft passes, prefill tokens),
   optionally with multiplicative log-normal noise;
5. call ``policy.observe`` with a :class:`~adaptive_spec.controller.StepOutcome` (emitted token ids = the
   true next tokens) and ``policy.release`` for finished requests.

Goodput is committed tokens over the summed step times. With a
:class:`~adaptive_spec.trace.TraceWriter` the run is also written as a trace in the engine's schema
(:mod:`adaptive_spec.trace`), which is how :mod:`adaptive_spec.sim.synthetic` records traces.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaptive_spec.arms import NO_SPEC, Arm
from adaptive_spec.controller import RequestOutcome, RequestView, SpecPolicy, StepOutcome, StepView
from adaptive_spec.metrics import SpecMetrics
from adaptive_spec.trace import TraceWriter

from .cost_profiles import CostProfile, is_draft_model
from .requests import ReplayRequest


@dataclass(slots=True)
class ReplayResult:
    """What one replay measured.

    Attributes
    ----------
    policy : str
        The policy's name.
    tokens : int
        Committed output tokens (all requests).
    time_s : float
        Summed simulated step time (seconds; idle time between arrivals excluded).
    steps, request_steps : int
        Simulated steps; request-steps (one request in one step, prefill included).
    drafted, accepted : int
        Draft tokens verified / accepted.
    arm_counts : Counter
        Arm played (``str(Arm)``) per decode request-step.
    metrics : SpecMetrics
        Per arm, proposer and category (time attributed equally within a step).
    step_time_s, step_tokens : numpy.ndarray, shape [steps]
        Per-step time (float64, s) and committed tokens (int64).
    step_arms : list of dict
        Per step ``{"requests": [{"arm": str}]}`` for the decode request-steps (the shape
        :func:`adaptive_spec.plots.plot_arm_choices` reads).
    sampled_request_steps : int
        Decode request-steps of requests with temperature > 0 (scored by equality: approximate).
    policy_time_s : float
        Wall time spent in ``decide`` and ``observe`` (not charged to the simulated clock).
    """

    policy: str
    tokens: int = 0
    time_s: float = 0.0
    steps: int = 0
    request_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    arm_counts: Counter = field(default_factory=Counter)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    step_time_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step_arms: list[dict[str, Any]] = field(default_factory=list)
    sampled_request_steps: int = 0
    policy_time_s: float = 0.0

    @property
    def goodput(self) -> float:
        """Committed tokens per second of simulated step time."""
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per request-step (1.0 without speculation; :mod:`adaptive_spec.metrics`)."""
        return self.tokens / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "tokens": self.tokens,
            "time_s": round(self.time_s, 6),
            "goodput_tok_s": round(self.goodput, 3),
            "steps": self.steps,
            "request_steps": self.request_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "arm_counts": dict(self.arm_counts.most_common()),
            "sampled_request_steps": self.sampled_request_steps,
            "policy_time_s": round(self.policy_time_s, 4),
            "by_category": {k: v.as_dict() for k, v in sorted(self.metrics.by_category.items())},
        }


@dataclass(slots=True)
class _Live:
    req: ReplayRequest
    n: int = 0  # output tokens committed


def _check_requests(requests: list[ReplayRequest]) -> None:
    seen = set()
    for r in requests:
        if not isinstance(r, ReplayRequest):
            raise ValueError(f"requests must be ReplayRequest objects; got {type(r).__name__}")
        if r.req_id in seen:
            raise ValueError(f"request id {r.req_id!r} appears twice; ids must be unique")
        seen.add(r.req_id)


def replay(
    requests: list[ReplayRequest],
    policy: SpecPolicy,
    profile: CostProfile,
    *,
    max_batch: int,
    proposers: list[str] | None = None,
    step_time_noise: float = 0.0,
    seed: int = 0,
    writer: TraceWriter | None = None,
) -> ReplayResult:
    """Simulate ``policy`` over ``requests`` (see the module docstring).

    Parameters
    ----------
    requests : list of ReplayRequest
        Admitted in this order (stable-sorted by ``arrival_s``).
    policy : SpecPolicy
        Any policy; it sees drafts of ``proposers`` only.
    profile : CostProfile
        Step time model.
    max_batch : int >= 1
        Largest number of requests in a step (the engine's ``max_num_seqs``).
    proposers : list of str, optional
        Proposers whose drafts the views carry (default: ``policy.proposers``).
    step_time_noise : float >= 0
        Sigma of a mean-one log-normal factor on each step time (0: deterministic).
    seed : int
        Seeds the step-time noise.
    writer : TraceWriter, optional
        Also write the run as a trace (request and step lines).

    Returns
    -------
    ReplayResult

    Raises
    ------
    ValueError
        For bad parameters, duplicate request ids, or a decision with the wrong number of arms or an
        arm whose proposer is not offered.
    """
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} is invalid; allowed: an integer >= 1")
    if not (math.isfinite(step_time_noise) and step_time_noise >= 0):
        raise ValueError(
            f"step_time_noise={step_time_noise!r} is invalid; allowed: a finite number >= 0"
        )
    _check_requests(requests)
    props = list(policy.proposers if proposers is None else proposers)
    props = [p for p in props if p != "none"]
    max_k = int(policy.max_k)
    rng = np.random.default_rng(seed)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    queue = deque(requests[i] for i in order)
    running: list[_Live] = []
    res = ReplayResult(policy=getattr(policy, "name", type(policy).__name__))
    clock = 0.0
    times: list[float] = []
    toks: list[int] = []
    sigma = float(step_time_noise)
    step = 0
    while queue or running:
        if not running and queue and queue[0].arrival_s > clock:
            clock = queue[0].arrival_s  # idle until the next arrival
        new: list[_Live] = []
        while queue and len(running) < max_batch and queue[0].arrival_s <= clock:
            live = _Live(queue.popleft())
            running.append(live)
            new.append(live)
        decode = [lv for lv in running if lv.n > 0]
        views = [
            RequestView(
                req_id=lv.req.req_id,
                num_output_tokens=lv.n,
                max_new_tokens=lv.req.max_tokens - lv.n,
                temperature=lv.req.temperature,
            )
            for lv in decode
        ]
        for lv, v in zip(decode, views, strict=True):
            for p in props:
                d = lv.req.draft(p, lv.n)
                if d is not None:
                    d = d[:max_k]  # the engine verifies at most num_speculative_tokens
                    v.drafts[p] = d
                    v.match_lengths[p] = lv.req.match_feature(p, lv.n) if d.size else 0
        t0 = time.perf_counter()
        decision = policy.decide(StepView(views, batch_size=len(running), queue_len=len(queue)))
        res.policy_time_s += time.perf_counter() - t0
        if len(decision.arms) != len(views):
            raise ValueError(
                f"policy {res.policy!r} returned {len(decision.arms)} arms for {len(views)} requests"
            )
        outcomes: list[RequestOutcome] = []
        rows: list[dict[str, Any]] = []
        verified = 0
        draft_passes = 0
        prefill = 0
        step_rows: list[tuple[_Live, str, str, int, int, int]] = []
        for i, (lv, v) in enumerate(zip(decode, views, strict=True)):
            arm = decision.arms[i]
            if not isinstance(arm, Arm):
                raise ValueError(f"policy {res.policy!r} returned {arm!r}; expected an Arm")
            out = lv.req.output_token_ids
            L = out.shape[0]
            d = v.drafts.get(arm.proposer) if arm.k > 0 else None
            if arm.k > 0 and arm.proposer not in v.drafts and arm.proposer not in props:
                raise ValueError(
                    f"policy {res.policy!r} chose {arm} but proposer {arm.proposer!r} is not offered; "
                    f"offered: {', '.join(props) or 'none'}"
                )
            chosen = d[: arm.k] if d is not None else np.zeros(0, dtype=np.int64)
            drafted = int(chosen.shape[0])
            played = arm if drafted > 0 else NO_SPEC
            if drafted > 0:
                m = lv.req.match_length(arm.proposer, lv.n)
                accepted = min(drafted, m)
            else:
                accepted = 0
            emitted = min(accepted + 1, L - lv.n)
            emitted_ids = out[lv.n : lv.n + emitted]
            verified += drafted
            if drafted and is_draft_model(played.proposer):
                draft_passes = max(draft_passes, drafted)
            if lv.req.temperature > 0:
                res.sampled_request_steps += 1
            before = lv.n
            lv.n += emitted
            finished = lv.n >= L
            outcomes.append(
                RequestOutcome(
                    lv.req.req_id,
                    played,
                    drafted,
                    accepted,
                    [int(t) for t in emitted_ids],
                    finished,
                )
            )
            step_rows.append((lv, str(played), played.proposer, drafted, accepted, emitted))
            if writer is not None:
                prop = decision.propensities[i] if i < len(decision.propensities) else None
                feats = decision.features[i] if i < len(decision.features) else None
                rows.append(
                    {
                        "req_id": lv.req.req_id,
                        "arm": str(played),
                        "drafted": drafted,
                        "accepted": accepted,
                        "emitted": emitted,
                        "emitted_token_ids": [int(t) for t in emitted_ids],
                        "num_output_before": before,
                        "features": feats,
                        "propensity": prop,
                        "cf_drafts": {p: [int(t) for t in dd] for p, dd in v.drafts.items()},
                        "target_argmax": (
                            [int(t) for t in out[before : before + drafted + 1]]
                            if drafted and accepted == drafted and before + drafted < L
                            else None
                        ),
                        "finished": finished,
                    }
                )
        for lv in new:
            out = lv.req.output_token_ids
            prefill += int(lv.req.prompt_token_ids.shape[0])
            lv.n = 1
            step_rows.append((lv, "none", "none", 0, 0, 1))
            if writer is not None:
                writer.request(
                    {
                        "req_id": lv.req.req_id,
                        "category": lv.req.category,
                        "prompt_token_ids": [int(t) for t in lv.req.prompt_token_ids],
                        "temperature": lv.req.temperature,
                        "max_tokens": lv.req.max_tokens,
                    }
                )
                rows.append(
                    {
                        "req_id": lv.req.req_id,
                        "arm": "none",
                        "drafted": 0,
                        "accepted": 0,
                        "emitted": 1,
                        "emitted_token_ids": [int(out[0])],
                        "num_output_before": 0,
                        "features": None,
                        "propensity": None,
                        "cf_drafts": None,
                        "target_argmax": None,
                        "finished": len(lv.req) == 1,
                    }
                )
        B = len(running)
        t_step = float(profile.step_time(B, verified, draft_passes, prefill))
        if sigma > 0:
            t_step *= float(np.exp(rng.normal(0.0, sigma) - 0.5 * sigma * sigma))
        t1 = time.perf_counter()
        policy.observe(StepOutcome(outcomes, t_step, B, verified, prefill))
        finished_ids = [lv.req.req_id for lv in running if lv.n >= len(lv.req)]
        for rid in finished_ids:
            policy.release(rid)
        res.policy_time_s += time.perf_counter() - t1
        share = t_step / B
        step_tok = 0
        arms_row = []
        for lv, arm_s, prop_s, drafted, accepted, emitted in step_rows:
            res.metrics.add_request_step(
                arm_s, prop_s, lv.req.category, drafted, accepted, emitted, share
            )
            step_tok += emitted
            res.drafted += drafted
            res.accepted += accepted
            if lv.n - emitted > 0:  # a decode request-step (not the prefill)
                res.arm_counts[arm_s] += 1
                arms_row.append({"arm": arm_s})
        res.metrics.add_step(t_step, 0.0)
        res.request_steps += len(step_rows)
        res.step_arms.append({"requests": arms_row})
        times.append(t_step)
        toks.append(step_tok)
        if writer is not None:
            writer.step(
                {
                    "step": step,
                    "time": clock,
                    "step_time_s": t_step,
                    "controller_time_s": 0.0,
                    "batch_size": B,
                    "num_verified_tokens": verified,
                    "num_prefill_tokens": prefill,
                    "queue_len": len(queue),
                    "fault": None,
                    "requests": rows,
                }
            )
        clock += t_step
        step += 1
        running = [lv for lv in running if lv.n < len(lv.req)]
    res.step_time_s = np.asarray(times, dtype=float)
    res.step_tokens = np.asarray(toks, dtype=np.int64)
    res.steps = len(times)
    res.tokens = int(res.step_tokens.sum())
    res.time_s = float(res.step_time_s.sum())
    return res
