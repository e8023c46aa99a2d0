"""The step driver: one engine step of adaptive speculation, the same code in vLLM and in replay.

An engine adapter (:mod:`adaptive_spec.vllm.attach` for vLLM, :func:`adaptive_spec.sim.replay.replay`
for a recorded workload) reports what happened and applies what was decided; everything in between is
here, so a policy improved offline behaves the same in the engine::

    add_request(...)                      a request is seen for the first time
    decide(live requests) -> drafts       proposers draft -> policy.decide -> drafts cut to k
    observe(verified requests, time)      outcome -> policy.observe, metrics, trace row

Between the two the engine verifies the drafts (vLLM's rejection sampler, or the simulator's prefix
match against the known output). Proposers listed in ``external`` are not run here: their drafts come
from the adapter (vLLM's own drafter for ``draft`` / ``lora:<name>``; logged drafts in replay).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptive_spec.core.arms import NO_SPEC, Arm, drafts_with_drafter
from adaptive_spec.core.metrics import SpecMetrics
from adaptive_spec.core.protocol import (
    RequestOutcome,
    RequestView,
    SpecPolicy,
    StepOutcome,
    StepView,
)
from adaptive_spec.core.trace import TraceWriter
from adaptive_spec.proposers.base import EMPTY, ProposalRequest, Proposer, controller_feature

logger = logging.getLogger(__name__)


class _TokenBuffer:
    """A request's token history (prompt + committed output) as a growable int64 array, so the per-step
    proposers get a view without copying the whole history."""

    __slots__ = ("arr", "n")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.arr = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        m = len(tokens)
        if self.n + m > len(self.arr):
            grown = np.empty(max(2 * len(self.arr), self.n + m), dtype=np.int64)
            grown[: self.n] = self.arr[: self.n]
            self.arr = grown
        if m <= 8:  # a step's tokens: element stores cost less than converting the list
            arr, n = self.arr, self.n
            for t in tokens:
                arr[n] = t
                n += 1
        else:
            self.arr[self.n : self.n + m] = tokens
        self.n += m

    def view(self) -> np.ndarray:
        return self.arr[: self.n]


@dataclass(slots=True)
class LiveRequest:
    """A running request the engine will decode in its next step (decision time).

    ``num_output_tokens``: committed output tokens; ``max_new_tokens``: tokens it may still emit (drafts
    are cut to ``max_new_tokens - 1``); ``temperature``: its sampling temperature (0 = greedy)."""

    req_id: str
    num_output_tokens: int
    max_new_tokens: int
    temperature: float = 0.0


@dataclass(slots=True)
class VerifiedRequest:
    """What one request's step did (observation time).

    ``drafted``: draft tokens verified; ``accepted``: of them accepted (after EOS/stop/length cuts);
    ``emitted_token_ids``: tokens committed (at most ``accepted + 1``); ``target_argmax``: int64
    [drafted + 1], the target's argmax at each verified position when the engine recorded it."""

    req_id: str
    drafted: int
    accepted: int
    emitted_token_ids: list[int]
    finished: bool = False
    target_argmax: np.ndarray | None = None


@dataclass(slots=True)
class DriverDecision:
    """Per decided request: its id, the draft tokens to verify (cut to k), the arm played, and whether
    the engine should record the target's argmax at its verified positions."""

    req_ids: list[str]
    drafts: list[list[int]]
    arms: list[Arm]
    argmax_wanted: list[bool]


class StepDriver:
    """Drives a :class:`~adaptive_spec.core.protocol.SpecPolicy` over engine steps (module docstring).

    Parameters
    ----------
    policy : SpecPolicy
    proposers : mapping of str to Proposer
        Proposers run here on each request's token history (n-gram, suffix, Jacobi).
    max_k : int
        The engine's ``num_speculative_tokens``.
    vocab_size : int
        Draft ids must lie in ``[0, vocab_size)``.
    external : sequence of str
        Proposers whose drafts the adapter passes to :meth:`decide` (``draft``, ``lora:<name>``; in
        replay also logged ``jacobi``).
    tracer : TraceWriter, optional
    metrics : SpecMetrics, optional
    controller_in_step_time : bool
        Whether the adapter's ``step_time_s`` contains the controller's time (the engine's measured
        steps do; replay's simulated clock does not). Without it every
        :class:`~adaptive_spec.core.protocol.StepOutcome` carries ``controller_time_s = 0``, and the
        policy charges no controller time to any step.
    """

    def __init__(
        self,
        policy: SpecPolicy,
        proposers: Mapping[str, Proposer],
        *,
        max_k: int,
        vocab_size: int,
        external: Sequence[str] = (),
        tracer: TraceWriter | None = None,
        metrics: SpecMetrics | None = None,
        controller_in_step_time: bool = True,
    ) -> None:
        self.policy = policy
        # Shared, not copied: the adapter's mapping is the one proposers are looked up in.
        self.proposers = proposers if isinstance(proposers, dict) else dict(proposers)
        self.max_k = int(max_k)
        self.vocab_size = int(vocab_size)
        self.external = tuple(external)
        self.tracer = tracer
        self.metrics = metrics if metrics is not None else SpecMetrics()
        if hasattr(policy, "log_features"):
            policy.log_features = tracer is not None
        self._tokens: dict[str, _TokenBuffer] = {}
        self._category: dict[str, str | None] = {}
        # Chosen at the last decision: arm, propensity, features, drafts offered (trace only).
        self._chosen: dict[
            str, tuple[Arm, float | None, list[float], dict[str, list[int]] | None, list[int]]
        ] = {}
        self._prompt_len: dict[str, int] = {}
        self._last: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}  # draft, argmax, accepted
        self._argmax_wanted: dict[str, bool] = {}
        self._any_argmax = False
        self._decision_info: dict[str, Any] | None = None
        self.faults = 0
        self.last_fault: str | None = None
        self.step_index = 0
        self.record_all_argmax = (
            False  # target argmax for every drafted request (trace diagnostics)
        )
        # The controller's time, measured here (seconds; StepOutcome's controller fields): the last
        # decision's policy.decide and each proposer's drafting, the last policy.observe, and the
        # last observe of the driver as a whole.
        self.controller_in_step_time = bool(controller_in_step_time)
        self._decide_s = 0.0
        self._proposer_s: dict[str, float] = {}
        self._policy_observe_s = 0.0
        self._observe_s = 0.0

    # -- requests -----------------------------------------------------------------------------------
    def has_request(self, req_id: str) -> bool:
        return req_id in self._tokens

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        *,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        category: str | None = None,
    ) -> None:
        """Start tracking a request (its prompt is the proposers' first context)."""
        self._tokens[req_id] = _TokenBuffer(prompt_token_ids)
        self._prompt_len[req_id] = len(prompt_token_ids)
        self._category[req_id] = category
        if self.tracer is not None:
            self.tracer.request(
                {
                    "req_id": req_id,
                    "category": category,
                    "prompt_token_ids": [int(t) for t in prompt_token_ids],
                    "temperature": float(temperature),
                    "max_tokens": max_tokens,
                }
            )

    def release(self, req_id: str) -> None:
        """Forget a request everywhere (finished, aborted or stopped outside the step loop)."""
        self._tokens.pop(req_id, None)
        self._prompt_len.pop(req_id, None)
        self._category.pop(req_id, None)
        self._chosen.pop(req_id, None)
        self._last.pop(req_id, None)
        self._argmax_wanted.pop(req_id, None)
        for p in self.proposers.values():
            p.release(req_id)
        try:
            self.policy.release(req_id)
        except Exception as e:
            self.fault("release", e)

    def num_tracked(self) -> int:
        return len(self._tokens)

    def token_ids(self, req_id: str) -> np.ndarray:
        """The request's prompt + committed output, int64 (a view: do not modify)."""
        buf = self._tokens.get(req_id)
        return buf.view() if buf is not None else EMPTY

    @property
    def any_argmax_wanted(self) -> bool:
        """Whether the last decision asked for the target's argmax rows of any request."""
        return self._any_argmax

    def argmax_wanted(self, req_id: str) -> bool:
        """Whether the last decision asked for the target's argmax at this request's verified rows."""
        return self._argmax_wanted.get(req_id, False)

    # -- decision -----------------------------------------------------------------------------------
    def decide(
        self,
        live: Sequence[LiveRequest],
        *,
        batch_size: int,
        queue_len: int = 0,
        external_drafts: Mapping[str, Mapping[str, Sequence[int]]] | None = None,
        external_match: Mapping[str, Mapping[str, int]] | None = None,
    ) -> DriverDecision:
        """Draft for every live request, ask the policy, cut the chosen drafts to k.

        ``external_drafts[p][req_id]``: the draft proposer ``p`` (one of ``external``) offers, and
        ``external_match[p][req_id]`` its match feature (0 when absent). Requests
        not added with :meth:`add_request` are skipped. Raises whatever the policy or a proposer
        raises (the adapter falls back to the engine's own behaviour for that step)."""
        K = self.max_k
        live = [r for r in live if r.req_id in self._tokens]
        self._decide_s, self._proposer_s = 0.0, {}
        self._chosen.clear()
        self._argmax_wanted.clear()
        self._any_argmax = False
        if not live:
            return DriverDecision([], [], [], [])
        # A step whose drafts the engine's drafter already made (paid for) is never a rest step: it
        # is how a resting policy sees the drafter's drafts again (its pass plan probes).
        paid = any(
            drafts_with_drafter(name) and any(len(d) for d in by_req.values())
            for name, by_req in (external_drafts or {}).items()
        )
        if not paid and self.policy.rests(batch_size):
            return self._rest_decision(live)
        views = [
            RequestView(r.req_id, r.num_output_tokens, r.max_new_tokens, r.temperature)
            for r in live
        ]
        if self.proposers:
            preqs = []
            for r in live:
                last = self._last.get(r.req_id)
                preqs.append(
                    ProposalRequest(
                        req_id=r.req_id,
                        token_ids=self._tokens[r.req_id].view(),
                        max_new_tokens=int(r.max_new_tokens),
                        vocab_size=self.vocab_size,
                        last_draft=last[0] if last is not None else None,
                        last_target_argmax=last[1] if last is not None else None,
                        last_accepted=last[2] if last is not None else 0,
                    )
                )
            ks = [K] * len(preqs)
            for name, prop in self.proposers.items():
                t0 = time.perf_counter()
                if name == "jacobi" and not getattr(self.policy, "wants_jacobi_guess", True):
                    # Jacobi drafts from a recorded verification; its initial guess (noise, but what
                    # starts Jacobi decoding) only where the policy asks for it.
                    guess = self.policy.jacobi_guess_wanted([pr.req_id for pr in preqs])
                    idx = [
                        i
                        for i, pr in enumerate(preqs)
                        if pr.last_target_argmax is not None or guess[i]
                    ]
                    sub = [preqs[i] for i in idx]
                    out = prop.propose(sub, [K] * len(sub)) if sub else []
                    for i, d in zip(idx, out, strict=True):
                        views[i].drafts[name] = d
                        views[i].match_lengths[name] = len(d)
                else:
                    out = prop.propose(preqs, ks)
                    for v, pr, d in zip(views, preqs, out, strict=True):
                        v.drafts[name] = d
                        if len(d):
                            v.match_lengths[name] = controller_feature(prop, pr)
                self._proposer_s[name] = time.perf_counter() - t0
        if external_drafts:
            for name, by_req in external_drafts.items():
                feats = (external_match or {}).get(name, {})
                for v in views:
                    d = by_req.get(v.req_id)
                    if d is not None:
                        v.drafts[name] = np.asarray(d[:K], dtype=np.int64)
                        if len(d):
                            v.match_lengths[name] = int(feats.get(v.req_id, 0))
        t0 = time.perf_counter()
        decision = self.policy.decide(StepView(views, batch_size=batch_size, queue_len=queue_len))
        self._decide_s = time.perf_counter() - t0
        if len(decision.arms) != len(views):
            raise ValueError(
                f"policy {self.policy.name!r} returned {len(decision.arms)} arms for {len(views)} requests"
            )
        self._decision_info = decision.info
        wanted = decision.argmax_wanted
        req_ids: list[str] = []
        drafts: list[list[int]] = []
        arms: list[Arm] = []
        flags: list[bool] = []
        trace = self.tracer is not None
        offered = (*self.proposers, *self.external)  # whose drafts can reach a decision
        props, feats_l = decision.propensities, decision.features
        n_props, n_feats = len(props), len(feats_l)
        # The target's argmax rows serve Jacobi's next draft only (and trace diagnostics).
        jacobi = "jacobi" in self.proposers
        all_argmax = (jacobi and wanted is None) or self.record_all_argmax
        for i, (v, arm) in enumerate(zip(views, decision.arms, strict=True)):
            if not isinstance(arm, Arm):
                raise ValueError(f"policy {self.policy.name!r} returned {arm!r}; expected an Arm")
            k = arm.k
            d = v.drafts.get(arm.proposer) if k > 0 else None
            if k > 0 and d is None and arm.proposer not in offered:
                raise ValueError(
                    f"policy {self.policy.name!r} chose {arm} but proposer {arm.proposer!r} is "
                    f"not offered; offered: {', '.join(offered) or 'none'}"
                )
            chosen = [] if d is None else d[:k].tolist()  # int64 arrays: Python ints
            if not chosen:
                arm = NO_SPEC
            elif len(chosen) < k:
                arm = Arm(arm.proposer, len(chosen))
            cf = {p: [int(t) for t in dd] for p, dd in v.drafts.items()} if trace else {}
            prop = props[i] if i < n_props else None
            feats = feats_l[i] if i < n_feats else []
            self._chosen[v.req_id] = (arm, prop, feats, cf, chosen)
            flag = bool(chosen) and (all_argmax or (jacobi and bool(wanted[i])))
            self._argmax_wanted[v.req_id] = flag
            req_ids.append(v.req_id)
            drafts.append(chosen)
            arms.append(arm)
            flags.append(flag)
        self._any_argmax = any(flags)
        return DriverDecision(req_ids, drafts, arms, flags)

    def _rest_decision(self, live: Sequence[LiveRequest]) -> DriverDecision:
        """A rest step (:meth:`SpecPolicy.rests <adaptive_spec.core.protocol.SpecPolicy.rests>`): no
        proposer runs, every request plays ``none``."""
        self._decision_info = {"rest": True}
        ids = [r.req_id for r in live]
        for rid in ids:
            self._chosen[rid] = (NO_SPEC, None, [], None, [])  # in the trace: nothing offered
        n = len(ids)
        return DriverDecision(ids, [[] for _ in range(n)], [NO_SPEC] * n, [False] * n)

    def clear_decision(self) -> None:
        """Forget the last decision (the adapter fell back to the engine's own drafts)."""
        self._chosen.clear()
        self._argmax_wanted.clear()
        self._any_argmax = False
        self._decision_info = None

    # -- observation --------------------------------------------------------------------------------
    def observe(
        self,
        verified: Sequence[VerifiedRequest],
        *,
        step_time_s: float,
        batch_size: int,
        num_verified_tokens: int,
        num_prefill_tokens: int = 0,
        queue_len: int = 0,
        start_time: float = 0.0,
        controller_time_s: float = 0.0,
        drafter_time_s: float = 0.0,
        drafter_adapters: bool = False,
        drafter_passes: int | None = None,
    ) -> StepOutcome:
        """Feed one step to the policy, the metrics and the trace; release finished requests.

        ``step_time_s`` is the step's full cost (seconds; the vLLM adapter measures from one
        ``schedule()`` to the next, so the controller pays for itself). ``controller_time_s``: time
        the adapter spent in hooks and in the decision for this step, added to the driver's own; the
        policy's outcome carries it with the driver's previous observation (which in the engine runs
        inside this step's measured time; see ``controller_in_step_time``), with the time of the
        policy's own verbs and of each proposer's drafting. ``drafter_time_s``: the
        part of the step a draft model's pass took (s), ``drafter_adapters``: whether it applied a
        LoRA adapter, ``drafter_passes``: its draft passes beyond the KV-cache pass
        (:class:`~adaptive_spec.core.protocol.StepOutcome`). A policy error loses the
        policy's update, never the step's metrics and trace record."""
        t0 = time.perf_counter()
        outcomes: list[RequestOutcome] = []
        rows: list[dict[str, Any]] = []
        trace = self.tracer is not None
        valid_time = step_time_s > 0 and math.isfinite(step_time_s)
        share = step_time_s / batch_size if batch_size and valid_time else 0.0
        # Metrics are added once per (proposer, k, category) of the step, not per request.
        groups: dict[tuple[str, int, str | None], list[int]] = {}
        for v in verified:
            rid = v.req_id
            buf = self._tokens.get(rid)
            n_before = 0
            if buf is not None:
                n_before = buf.n
                buf.extend(v.emitted_token_ids)
            chosen = self._chosen.pop(rid, None)
            arm = chosen[0] if chosen is not None and v.drafted > 0 else NO_SPEC
            if v.drafted > 0 and v.target_argmax is not None and chosen is not None:
                d = np.asarray(chosen[4][: v.drafted], dtype=np.int64)
                if len(d) != v.drafted:  # the engine verified other drafts (a fallback step)
                    d = np.resize(d, v.drafted) if len(d) else np.zeros(v.drafted, dtype=np.int64)
                self._last[rid] = (d, np.asarray(v.target_argmax, dtype=np.int64), v.accepted)
            else:
                self._last.pop(rid, None)
            if chosen is not None or v.drafted > 0:
                outcomes.append(
                    RequestOutcome(
                        rid, arm, v.drafted, v.accepted, list(v.emitted_token_ids), v.finished
                    )
                )
            gkey = (arm.proposer, arm.k, self._category.get(rid))  # NO_SPEC when nothing drafted
            g = groups.get(gkey)
            if g is None:
                groups[gkey] = [1, v.drafted, v.accepted, len(v.emitted_token_ids)]
            else:
                g[0] += 1
                g[1] += v.drafted
                g[2] += v.accepted
                g[3] += len(v.emitted_token_ids)
            if trace:
                rows.append(
                    {
                        "req_id": rid,
                        "arm": str(arm),
                        "drafted": v.drafted,
                        "accepted": v.accepted,
                        "emitted": len(v.emitted_token_ids),
                        "emitted_token_ids": [int(t) for t in v.emitted_token_ids],
                        "num_output_before": n_before - self._prompt_len.get(rid, 0),
                        "features": chosen[2] if chosen else None,
                        "propensity": chosen[1] if chosen else None,
                        "cf_drafts": chosen[3] if chosen else None,
                        "target_argmax": (
                            [int(t) for t in v.target_argmax]
                            if v.target_argmax is not None
                            else None
                        ),
                        "finished": v.finished,
                    }
                )
        for (prop, k, cat), (n, drafted, accepted, emitted) in groups.items():
            self.metrics.add_request_step(
                "none" if k == 0 else f"{prop}:{k}", prop, cat, drafted, accepted, emitted,
                n * share, n,
            )  # fmt: skip
        outcome = StepOutcome(
            outcomes,
            step_time_s,
            batch_size,
            num_verified_tokens,
            num_prefill_tokens,
            drafter_time_s,
            drafter_adapters,
            drafter_passes,
            controller_time_s + self._observe_s if self.controller_in_step_time else 0.0,
            self._decide_s + self._policy_observe_s,
            self._proposer_s,
        )
        self._decide_s, self._proposer_s, self._policy_observe_s = 0.0, {}, 0.0
        try:
            if outcomes or valid_time:
                t1 = time.perf_counter()
                self.policy.observe(outcome)
                self._policy_observe_s = time.perf_counter() - t1
        except Exception as e:
            self.fault("observe", e)
        for v in verified:
            if v.finished:
                self.release(v.req_id)
        self._observe_s = time.perf_counter() - t0
        controller_s = controller_time_s + self._observe_s
        self.metrics.add_step(step_time_s if valid_time else 0.0, controller_s)
        if not valid_time:
            self.metrics.ignored_step_times += 1
        if trace:
            self.tracer.step(
                {
                    "step": self.step_index,
                    "time": start_time,
                    "step_time_s": step_time_s,
                    "controller_time_s": controller_s,
                    "batch_size": batch_size,
                    "num_verified_tokens": num_verified_tokens,
                    "num_prefill_tokens": num_prefill_tokens,
                    "drafter_time_s": drafter_time_s,
                    "drafter_adapters": drafter_adapters,
                    "drafter_passes": drafter_passes,
                    "queue_len": queue_len,
                    "fault": self.last_fault,
                    "decision": self._decision_info,
                    "requests": rows,
                }
            )
        self.last_fault = None
        self._decision_info = None
        self.step_index += 1
        return outcome

    # -- faults -------------------------------------------------------------------------------------
    def fault(self, where: str, err: BaseException) -> None:
        """Count and log a controller fault (the step falls back to the engine's behaviour)."""
        self.faults += 1
        self.metrics.faults += 1
        self.last_fault = f"{where}: {type(err).__name__}: {err}"
        if self.faults <= 5 or self.faults % 1000 == 0:
            logger.warning(
                "adaptive-spec controller fault #%d in %s (%s: %s); this step falls back to the engine's behaviour",
                self.faults,
                where,
                type(err).__name__,
                err,
                exc_info=self.faults <= 1,
            )
