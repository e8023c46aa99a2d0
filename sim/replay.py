"""Offline replay: run any :class:`~adaptive_spec.core.protocol.SpecPolicy` over a recorded workload.

The simulator advances every request along its known output sequence, through the same step driver
as the engine (:class:`adaptive_spec.core.driver.StepDriver`: views, decision, drafts cut to k, outcomes,
metrics, trace rows), so a policy behaves here as it does in vLLM. Per simulated step:

1. admit waiting requests (in the given order, once arrived) until ``max_batch`` run; a newly admitted
   request spends this step in prefill and emits its first output token (no drafts, as in vLLM);
2. build a :class:`~adaptive_spec.core.controller.StepView` for the decoding requests, with each proposer's
   counterfactual draft at the request's current position, and call ``policy.decide``;
3. per request: cut the chosen proposer's draft to k (an empty draft means no speculation), accepted
   length = common prefix of the draft and the true next tokens, emitted = accepted + 1 (the bonus or
   correction token), truncated at the end of the output;
4. charge the cost profile's step time for (batch size, verified tokens, draft passes, prefill tokens:
   those the engine computed, :attr:`~adaptive_spec.sim.requests.ReplayRequest.prefill_len`),
   optionally with multiplicative log-normal noise;
5. call ``policy.observe`` with a :class:`~adaptive_spec.core.controller.StepOutcome` (emitted token ids = the
   true next tokens) and ``policy.release`` for finished requests.

The simulated clock holds no controller time, for any policy: the driver runs with
``controller_in_step_time=False``, so every outcome carries ``controller_time_s = 0`` and the
adaptive controller charges no controller time to the safety rule's baseline
(:mod:`adaptive_spec.core.controller_cost`). The controller times the trace recorded are not used
(they are the recording run's policy's, on its machine); the replay's own are measured
(``policy_time_s``, and the driver's observation in the trace it writes, if any).

With ``drafter_pass_s = (plain, adapted)``, the run models an engine built with a draft model: its
pass runs every step whatever is played, costing ``adapted`` seconds when the policy wanted LoRA
adapters applied (:meth:`~adaptive_spec.core.protocol.SpecPolicy.drafter_adapters_wanted` after the
step's decision; only a policy with a ``lora:<name>`` proposer applies any) and ``plain`` otherwise,
and ``lora:<name>`` drafts are offered only at the step after an adapted pass, as in vLLM (the pass
of a step makes the drafts the next one verifies). The pass's time and kind reach the policy's
:class:`~adaptive_spec.core.protocol.StepOutcome`.

Goodput is committed tokens over the summed step times. With a
:class:`~adaptive_spec.core.trace.TraceWriter` the run is also written as a trace in the engine's schema
(:mod:`adaptive_spec.core.trace`), which is how :mod:`adaptive_spec.sim.synthetic` records traces.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaptive_spec.core.arms import NO_SPEC
from adaptive_spec.core.driver import LiveRequest, StepDriver, VerifiedRequest
from adaptive_spec.core.metrics import SpecMetrics
from adaptive_spec.core.protocol import SpecPolicy
from adaptive_spec.core.trace import TraceWriter

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
        :func:`adaptive_spec.commands.plots.plot_arm_choices` reads).
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
        """Tokens committed per request-step (1.0 without speculation; :mod:`adaptive_spec.core.metrics`)."""
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
    drafter_pass_s: tuple[float, float] | None = None,
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
    drafter_pass_s : (float, float), optional
        Seconds of a plain and of an adapted draft-model pass, charged every step (see the module
        docstring); None (default): no draft-model pass beyond the profile's ``draft_passes``.

    Returns
    -------
    ReplayResult

    Raises
    ------
    ValueError
        For bad parameters, duplicate request ids, or a decision with the wrong number of arms or an
        arm whose proposer is not offered.
    """
    run = ReplayRun(
        requests,
        policy,
        profile,
        max_batch=max_batch,
        proposers=proposers,
        step_time_noise=step_time_noise,
        seed=seed,
        writer=writer,
        drafter_pass_s=drafter_pass_s,
    )
    while not run.done:
        run.step()
    return run.result()


class ReplayRun:
    """One replay advanced a simulated step at a time (what :func:`replay` runs to the end; several
    runs advanced side by side model data-parallel replicas, :mod:`adaptive_spec.sim.replicas`).

    The parameters are :func:`replay`'s. Between two :meth:`step` calls the caller may read or change
    the policy's learned state (as the engine's runtime does between engine steps).

    Attributes
    ----------
    clock : float
        Simulated time (seconds) at which the next step starts.
    finished : int
        Requests completed so far.
    """

    def __init__(
        self,
        requests: list[ReplayRequest],
        policy: SpecPolicy,
        profile: CostProfile,
        *,
        max_batch: int,
        proposers: list[str] | None = None,
        step_time_noise: float = 0.0,
        seed: int = 0,
        writer: TraceWriter | None = None,
        drafter_pass_s: tuple[float, float] | None = None,
    ) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} is invalid; allowed: an integer >= 1")
        if not (math.isfinite(step_time_noise) and step_time_noise >= 0):
            raise ValueError(
                f"step_time_noise={step_time_noise!r} is invalid; allowed: a finite number >= 0"
            )
        if drafter_pass_s is not None and not (
            len(drafter_pass_s) == 2 and all(math.isfinite(x) and x >= 0 for x in drafter_pass_s)
        ):
            raise ValueError(
                f"drafter_pass_s={drafter_pass_s!r} is invalid; allowed: None or (plain, adapted) "
                "seconds, both finite and >= 0"
            )
        _check_requests(requests)
        props = list(policy.proposers if proposers is None else proposers)
        self.policy = policy
        self.profile = profile
        self.max_batch = max_batch
        self.props = [p for p in props if p != "none"]
        self.has_adapted = any(p.startswith("lora:") for p in self.props)
        self.adapted_pass = False  # whether the previous step's drafter pass applied adapters
        self.drafter_pass_s = drafter_pass_s
        self.max_k = int(policy.max_k)
        self.rng = np.random.default_rng(seed)
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
        self.queue = deque(requests[i] for i in order)
        self.running: list[_Live] = []
        self.res = ReplayResult(policy=getattr(policy, "name", type(policy).__name__))
        # The same step code as the engine: drafts come from the requests' tables (external proposers).
        self.driver = StepDriver(
            policy,
            {},
            max_k=self.max_k,
            vocab_size=1 << 31,
            external=self.props,
            tracer=writer,
            metrics=self.res.metrics,
            controller_in_step_time=False,
        )
        self.clock = 0.0
        self.finished = 0
        self.times: list[float] = []
        self.toks: list[int] = []
        self.sigma = float(step_time_noise)

    @property
    def done(self) -> bool:
        """Whether every request has completed."""
        return not (self.queue or self.running)

    def step(self) -> None:
        """Simulate one engine step (see the module docstring); nothing when :attr:`done`."""
        if self.done:
            return
        queue, running, res, driver = self.queue, self.running, self.res, self.driver
        props, max_k, policy = self.props, self.max_k, self.policy
        drafter_pass_s = self.drafter_pass_s
        if not running and queue and queue[0].arrival_s > self.clock:
            self.clock = queue[0].arrival_s  # idle until the next arrival
        new: list[_Live] = []
        while queue and len(running) < self.max_batch and queue[0].arrival_s <= self.clock:
            live = _Live(queue.popleft())
            running.append(live)
            new.append(live)
            r = live.req
            driver.add_request(
                r.req_id,
                r.prompt_token_ids,
                temperature=r.temperature,
                max_tokens=r.max_tokens,
                category=r.category,
            )
        decode = [lv for lv in running if lv.n > 0]
        ext: dict[str, dict[str, np.ndarray]] = {p: {} for p in props}
        match: dict[str, dict[str, int]] = {p: {} for p in props}
        for lv in decode:
            for p in props:
                if drafter_pass_s is not None and not self.adapted_pass and p.startswith("lora:"):
                    continue  # the last pass made no adapted drafts
                d = lv.req.draft(p, lv.n)
                if d is not None:
                    ext[p][lv.req.req_id] = d[:max_k]  # the engine verifies at most max_k
                    if d.size:
                        match[p][lv.req.req_id] = lv.req.match_feature(p, lv.n)
        t0 = time.perf_counter()
        dec = driver.decide(
            [
                LiveRequest(lv.req.req_id, lv.n, lv.req.max_tokens - lv.n, lv.req.temperature)
                for lv in decode
            ],
            batch_size=len(running),
            queue_len=len(queue),
            external_drafts=ext,
            external_match=match,
        )
        res.policy_time_s += time.perf_counter() - t0
        if drafter_pass_s is not None:
            self.adapted_pass = self.has_adapted and policy.drafter_adapters_wanted()
        adapted_pass = self.adapted_pass
        chosen = dict(zip(dec.req_ids, zip(dec.drafts, dec.arms, strict=True), strict=True))
        verified: list[VerifiedRequest] = []
        n_verified = 0
        draft_passes = 0
        prefill = 0
        arms_row = []
        for lv in decode:
            rid = lv.req.req_id
            draft, arm = chosen.get(rid, ([], NO_SPEC))
            out = lv.req.output_token_ids
            L = out.shape[0]
            drafted = len(draft)
            accepted = min(drafted, lv.req.match_length(arm.proposer, lv.n)) if drafted else 0
            emitted = min(accepted + 1, L - lv.n)
            ids = out[lv.n : lv.n + emitted]
            n_verified += drafted
            if drafted and is_draft_model(arm.proposer):
                draft_passes = max(draft_passes, drafted)
            if lv.req.temperature > 0:
                res.sampled_request_steps += 1
            argmax = (
                out[lv.n : lv.n + drafted + 1]
                if drafted and accepted == drafted and lv.n + drafted < L
                else None
            )
            lv.n += emitted
            verified.append(
                VerifiedRequest(rid, drafted, accepted, [int(t) for t in ids], lv.n >= L, argmax)
            )
            res.arm_counts[str(arm) if drafted else "none"] += 1
            arms_row.append({"arm": str(arm) if drafted else "none"})
            res.drafted += drafted
            res.accepted += accepted
        for lv in new:
            prefill += lv.req.prefill_len
            lv.n = 1
            verified.append(
                VerifiedRequest(
                    lv.req.req_id, 0, 0, [int(lv.req.output_token_ids[0])], len(lv.req) == 1
                )
            )
        B = len(running)
        t_step = float(self.profile.step_time(B, n_verified, draft_passes, prefill))
        sigma = self.sigma
        if sigma > 0:
            t_step *= float(np.exp(self.rng.normal(0.0, sigma) - 0.5 * sigma * sigma))
        drafter_s = 0.0
        if drafter_pass_s is not None:
            drafter_s = drafter_pass_s[1] if adapted_pass else drafter_pass_s[0]
            t_step += drafter_s
        t1 = time.perf_counter()
        driver.observe(
            verified,
            step_time_s=t_step,
            batch_size=B,
            num_verified_tokens=n_verified,
            num_prefill_tokens=prefill,
            queue_len=len(queue),
            start_time=self.clock,
            drafter_time_s=drafter_s,
            drafter_adapters=adapted_pass,
        )
        res.policy_time_s += time.perf_counter() - t1
        step_tok = sum(len(v.emitted_token_ids) for v in verified)
        res.request_steps += len(verified)
        res.step_arms.append({"requests": arms_row})
        self.times.append(t_step)
        self.toks.append(step_tok)
        self.clock += t_step
        self.running = [lv for lv in running if lv.n < len(lv.req)]
        self.finished += len(running) - len(self.running)

    def result(self) -> ReplayResult:
        """What the run measured so far (the whole replay once :attr:`done`)."""
        res = self.res
        res.step_time_s = np.asarray(self.times, dtype=float)
        res.step_tokens = np.asarray(self.toks, dtype=np.int64)
        res.steps = len(self.times)
        res.tokens = int(res.step_tokens.sum())
        res.time_s = float(res.step_time_s.sum())
        # Replay charges no controller time to the simulated clock.
        res.metrics.controller_time_s = 0.0
        return res
