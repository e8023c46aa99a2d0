"""The step protocol between an engine (or the replay simulator) and a speculation policy.

Every policy is driven through the same two verbs, one engine step at a time (the step driver,
:mod:`adaptive_spec.core.driver`, does the driving both in vLLM and in replay):

* ``decide(view) -> Decision``: given the running requests and the drafts every proposer offers now,
  choose an arm ``(proposer, k)`` per request;
* ``observe(outcome)``: learn from what verification committed and how long the step took.

The dataclasses below are the step's metadata (one comment per field for its shape and unit), in the
style of vLLM's ``v1/spec_decode`` metadata: data flows one way, from the engine to the policy and
back as a decision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaptive_spec.core.arms import Arm, check_proposer_name


@dataclass(slots=True)
class RequestView:
    """What a policy sees of one running request at decision time.

    ``drafts[p]`` is the full draft (int64 token ids, length 0..max_k) proposer ``p`` offers now; a
    proposer absent from ``drafts`` offers nothing. ``max_new_tokens`` is the remaining budget (drafts
    are capped at ``max_new_tokens - 1``).
    """

    req_id: str
    num_output_tokens: int
    max_new_tokens: int
    temperature: float = 0.0
    drafts: dict[str, np.ndarray] = field(default_factory=dict)
    match_lengths: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StepView:
    """The batch a policy decides for. ``batch_size`` is the number of requests expected in the step
    that verifies these drafts; ``queue_len`` the number waiting."""

    requests: list[RequestView]
    batch_size: int
    queue_len: int = 0


@dataclass(slots=True)
class Decision:
    """Per request (same order as the view): the arm, its propensity (None when not known exactly),
    and the logged context vector.

    ``argmax_wanted`` (optional, bool per request): whether the engine should record the target's
    argmax at this request's verified positions in the coming step (what the Jacobi proposer drafts
    from next); ``None`` means every request that verifies drafts. ``info`` (optional): per-step
    facts for the trace (e.g. whether the safety rule kept the baseline)."""

    arms: list[Arm]
    propensities: list[float | None]
    features: list[list[float]]
    argmax_wanted: list[bool] | None = None
    info: dict[str, Any] | None = None


@dataclass(slots=True)
class RequestOutcome:
    """What one request's verification gave: ``drafted`` draft tokens verified, ``accepted`` of them
    accepted, ``emitted_token_ids`` the tokens committed (after EOS/stop/length truncation)."""

    req_id: str
    arm: Arm
    drafted: int
    accepted: int
    emitted_token_ids: list[int]
    finished: bool = False


@dataclass(slots=True)
class StepOutcome:
    """One engine step: per-request outcomes, wall time (seconds), requests in the step, draft tokens
    verified, and prompt (prefill) tokens computed. On an engine with a draft model,
    ``drafter_time_s`` is the part of ``step_time_s`` that the draft model's pass took (seconds; 0
    elsewhere), ``drafter_adapters`` whether that pass applied a LoRA adapter to some request, and
    ``drafter_passes`` the draft passes it ran beyond the one that keeps its KV cache current (None
    when not known: the drafter's time is then all treated as fixed).

    The controller's own time inside ``step_time_s`` (seconds, measured by the step driver,
    :mod:`adaptive_spec.core.driver`): ``controller_time_s`` all of it (the adapter's hooks and this
    step's decision, and the driver's previous observation, which in the engine runs inside this
    step's measured time; 0 when ``step_time_s`` holds no controller time, as in replay's simulated
    clock), ``policy_time_s`` the part in the policy's own ``decide`` (this step's) and ``observe``
    (the previous step's), and ``proposer_time_s`` the part each proposer the driver ran took
    drafting for this step's decision (empty on a rest step)."""

    requests: list[RequestOutcome]
    step_time_s: float
    batch_size: int
    num_verified_tokens: int
    num_prefill_tokens: int = 0
    drafter_time_s: float = 0.0
    drafter_adapters: bool = False
    drafter_passes: int | None = None
    controller_time_s: float = 0.0
    policy_time_s: float = 0.0
    proposer_time_s: dict[str, float] = field(default_factory=dict)


class SpecPolicy(ABC):
    """Base class: a policy decides arms for a batch and learns from outcomes.

    Subclasses implement :meth:`decide`; :meth:`observe`, :meth:`release` and the state methods default
    to no-ops for policies that do not learn.
    """

    name: str = "policy"
    #: Whether Jacobi's initial guess (the last token repeated) is offered to requests without a
    #: recorded verification; a policy that wants it only for some requests sets False and answers
    #: :meth:`jacobi_guess_wanted`.
    wants_jacobi_guess: bool = True

    def __init__(self, proposers: list[str], max_k: int) -> None:
        if not isinstance(max_k, int) or max_k < 0:
            raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 0")
        self.proposers = [check_proposer_name(p) for p in proposers if p != "none"]
        self.max_k = max_k

    @abstractmethod
    def decide(self, view: StepView) -> Decision: ...

    def observe(self, outcome: StepOutcome) -> None:  # noqa: B027 (optional hook)
        """Learn from one step's outcome (default: nothing)."""

    def release(self, req_id: str) -> None:  # noqa: B027 (optional hook)
        """Drop per-request state when a request finishes (default: nothing)."""

    def num_tracked_requests(self) -> int:
        return 0

    def state_dict(self) -> dict:
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 (optional hook)
        """Restore learned state (default: nothing)."""

    def add_learning(self, delta: dict) -> bool:
        """Add what other replicas learned (the difference of two :meth:`state_dict` documents) to
        this policy's learned state; False when the policy does not take it in (the default)."""
        return False

    def rests(self, batch_size: int) -> bool:
        """Whether the coming step is a **rest step**: the step driver skips the proposers and
        :meth:`decide`, every request plays ``none``, and :meth:`observe` still gets the outcome (with
        nothing pending from a decision). A policy that has found nothing worth drafting for a while
        rests to cost next to nothing; the default never does. The driver does not ask on a step
        for which the engine's drafter has already made drafts (they are paid for)."""
        return False

    def jacobi_guess_wanted(self, req_ids: list[str]) -> list[bool]:
        """For a policy with ``wants_jacobi_guess = False``: which of these requests without a
        recorded verification should still be offered Jacobi's initial guess (default: none)."""
        return [False] * len(req_ids)

    def drafter_preference(self, req_id: str, candidates: list[str]) -> str | None:
        """Which draft-model proposer (``draft`` or ``lora:<name>``) should make ``req_id``'s next
        drafts: the engine's drafter runs once per step with one adapter per request, so only the chosen
        one's drafts exist at the next decision. ``None`` (the default) leaves the choice to the caller
        (keep the adapter of the chosen arm, else the current one)."""
        return None

    def drafter_k_cap(self) -> int | None:
        """The most draft tokens this policy will ever take from the engine's drafter in one step, or
        None (the default) when it may take up to ``max_k``. The drafter's pass plan
        (:class:`~adaptive_spec.core.drafter_passes.DrafterPasses`) probes longer chains only up to it,
        so a policy that never uses them does not pay for them (0: the drafter runs no draft passes)."""
        return None

    def drafter_adapters_wanted(self) -> bool:
        """Whether the drafter's next pass may apply LoRA adapters (default: yes). A pass that
        applies one costs more than a plain one; with False every request's next drafts come from
        the base draft model."""
        return True


def matched_prefix(draft: np.ndarray, emitted: list[int] | np.ndarray) -> int:
    """Length of the longest common prefix of ``draft`` and ``emitted``."""
    n = min(len(draft), len(emitted))
    if n == 0:
        return 0
    eq = np.asarray(draft[:n]) == np.asarray(emitted[:n])
    return n if eq.all() else int(np.argmin(eq))


def acceptance_rows(draft_len: int, emitted_len: int, matched: int) -> tuple[int, int]:
    """Censored per-position labels of a draft against emitted tokens.

    Returns ``(n_ones, n_zero)``: positions ``1..n_ones`` are accepted, and ``n_zero`` (0 or 1) rejected
    positions follow. Positions after the first rejection, or beyond the emitted tokens, are unknown.
    """
    n_ones = matched
    n_zero = 1 if (matched < draft_len and matched < emitted_len) else 0
    return n_ones, n_zero
