"""A policy wrapper that logs every decision (for regret analyses and tests)."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepOutcome, StepView


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One request-step decision: request, output tokens before the step, the proposers that offered
    a non-empty draft, the remaining budget, and the arm chosen."""

    step: int
    req_id: str
    position: int
    offered: frozenset[str]
    remaining: int
    arm: Arm


class RecordingPolicy(SpecPolicy):
    """Delegates to ``inner`` and appends a :class:`DecisionRecord` per request-step to ``log``."""

    def __init__(self, inner: SpecPolicy) -> None:
        super().__init__(inner.proposers, inner.max_k)
        self.inner = inner
        self.name = inner.name
        self.log: list[DecisionRecord] = []
        self._step = 0

    def decide(self, view: StepView) -> Decision:
        d = self.inner.decide(view)
        for r, a in zip(view.requests, d.arms, strict=True):
            offered = frozenset(p for p, x in r.drafts.items() if x.size)
            self.log.append(
                DecisionRecord(
                    self._step, r.req_id, r.num_output_tokens, offered, r.max_new_tokens, a
                )
            )
        self._step += 1
        return d

    def observe(self, outcome: StepOutcome) -> None:
        self.inner.observe(outcome)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)

    def num_tracked_requests(self) -> int:
        return self.inner.num_tracked_requests()
