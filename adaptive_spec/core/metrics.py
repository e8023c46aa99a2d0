"""Speculation metrics, computed from committed tokens.

Definitions (per request-step, i.e. one request in one engine step):

* ``drafted``: draft tokens verified; ``accepted``: of those, accepted by verification;
* ``emitted``: tokens committed (after EOS / stop / ``max_tokens`` truncation), at most ``accepted + 1``
  (the bonus token, or the target's correction at the first rejection, is not an accepted draft token);
* acceptance rate ``= sum accepted / sum drafted`` (0 when nothing was drafted, never a division by zero);
* mean accepted length ``= sum emitted / request-steps``: tokens committed per verification (1.0 without
  speculation), the figure the speculative-decoding literature calls tau;
* attributed goodput ``= sum emitted / sum (step time / batch size)`` in tokens/s: each request-step is
  charged an equal share of its step's wall time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(slots=True)
class ArmStats:
    request_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    time_s: float = 0.0

    def add(
        self, drafted: int, accepted: int, emitted: int, time_share_s: float, n: int = 1
    ) -> None:
        """Count ``n`` request-steps with these totals (``time_share_s``: their summed share of
        step time, seconds)."""
        self.request_steps += n
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.time_s += time_share_s

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.request_steps if self.request_steps else 0.0

    @property
    def goodput(self) -> float:
        return self.emitted / self.time_s if self.time_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "request_steps": self.request_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "goodput_tok_s": round(self.goodput, 2),
        }


class SpecMetrics:
    """Aggregates per-arm, per-proposer and per-category statistics, plus step-level totals."""

    def __init__(self) -> None:
        self.by_arm: dict[str, ArmStats] = defaultdict(ArmStats)
        self.by_proposer: dict[str, ArmStats] = defaultdict(ArmStats)
        self.by_category: dict[str, ArmStats] = defaultdict(ArmStats)
        self.arm_by_category: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.steps = 0
        self.step_time_s = 0.0
        self.controller_time_s = 0.0
        self.faults = 0
        self.ignored_step_times = 0

    def add_request_step(
        self,
        arm: str,
        proposer: str,
        category: str | None,
        drafted: int,
        accepted: int,
        emitted: int,
        time_share_s: float,
        n: int = 1,
    ) -> None:
        """Count ``n`` request-steps of one arm, proposer and category with these totals
        (``time_share_s``: their summed share of step time, seconds)."""
        self.by_arm[arm].add(drafted, accepted, emitted, time_share_s, n)
        self.by_proposer[proposer].add(drafted, accepted, emitted, time_share_s, n)
        cat = category or "all"
        self.by_category[cat].add(drafted, accepted, emitted, time_share_s, n)
        self.arm_by_category[cat][arm] += n

    def add_step(self, step_time_s: float, controller_time_s: float) -> None:
        self.steps += 1
        self.step_time_s += step_time_s
        self.controller_time_s += controller_time_s

    @property
    def controller_overhead(self) -> float:
        """Controller time as a share of engine step time."""
        return self.controller_time_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "step_time_s": round(self.step_time_s, 4),
            "controller_time_s": round(self.controller_time_s, 4),
            "controller_overhead": round(self.controller_overhead, 4),
            "faults": self.faults,
            "ignored_step_times": self.ignored_step_times,
            "by_arm": {k: v.as_dict() for k, v in sorted(self.by_arm.items())},
            "by_proposer": {k: v.as_dict() for k, v in sorted(self.by_proposer.items())},
            "by_category": {k: v.as_dict() for k, v in sorted(self.by_category.items())},
            "arm_mix_by_category": {
                c: dict(sorted(m.items())) for c, m in sorted(self.arm_by_category.items())
            },
        }
