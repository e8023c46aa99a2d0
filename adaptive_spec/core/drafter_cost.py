"""What an engine's draft-model pass costs, and whether LoRA adapters on it pay for their extra time.

On an engine built with a draft model, vLLM runs the draft model once per step for every running
request, whatever the controller plays: that pass is a fixed part of the step, outside the
step-cost table (which prices the target's verification) and outside the controller's decisions.
LoRA adapters on the drafter (:class:`~adaptive_spec.vllm.lora_draft.LoraDraftManager`) change that: a
pass in which some request uses an adapter costs more than a plain one (inside the compiled pass on an
engine built with LoRA sites: about 1.2-1.3x for the shipped EAGLE-3 head on 2 CPU cores; eagerly on
any other engine: about 1.6x). An engine without the adapters (the baseline an operator would
otherwise run) never pays it.

:class:`DrafterCost` keeps moving averages of both kinds of pass, so that

* the step-cost table and its load factor learn from the step minus the draft pass (a pass of fixed
  cost read as load would scale every draft token's price);
* the decisions add only the drafter's fixed part to every step's predicted time
  (:attr:`DrafterCost.fixed_s`): on an engine whose passes follow the decisions
  (:mod:`adaptive_spec.core.drafter_passes`), what a step without draft passes costs (the KV-cache pass,
  or its stash where that pass is deferred), not the mean of all steps (a probe's passes would
  otherwise be read as a fixed cost of the steps after it, which shifts every k up);
* the safety rule charges the baseline the plain pass, not the adapted one: the baseline's time on
  a step is the measured time minus :meth:`DrafterCost.observe`'s extra;
* the next pass applies adapters only while they pay: :meth:`DrafterCost.decide` compares the
  tokens the adapted drafts are predicted to add per step (the decision's expected tokens on the
  requests that play an adapted draft, minus what the best other proposer offers them at the same
  k) with the extra time valued at the step's predicted goodput, and requires the safety rule's
  slack to cover the extra time. Otherwise the pass is plain and, every ``probe_gap`` steps (the gap
  doubles after each probe that did not pay, up to ``max_probe_gap``), one adapted pass keeps the
  adapters' acceptance and cost measured, so an adapter that starts to pay is found again.
"""

from __future__ import annotations

import math


class DrafterCost:
    """Moving averages of the draft model's plain and adapted passes, and the adapters' decision.

    Parameters
    ----------
    weight : float in (0, 1]
        Weight of a new sample in the moving averages (the first sample of each is taken as is).
    probe_gap, max_probe_gap : int
        Steps between adapted passes while adapters do not pay: starts at ``probe_gap``, doubles
        after each probe, at most ``max_probe_gap``.

    Raises
    ------
    ValueError
        For a ``weight`` outside (0, 1] or gaps that are not integers with
        ``1 <= probe_gap <= max_probe_gap``.
    """

    def __init__(self, weight: float = 0.1, probe_gap: int = 16, max_probe_gap: int = 256) -> None:
        if not (isinstance(weight, int | float) and 0.0 < weight <= 1.0):
            raise ValueError(f"weight={weight!r} is invalid; allowed: 0 < weight <= 1")
        if not (
            isinstance(probe_gap, int)
            and isinstance(max_probe_gap, int)
            and 1 <= probe_gap <= max_probe_gap
        ):
            raise ValueError(
                f"probe_gap={probe_gap!r}, max_probe_gap={max_probe_gap!r} are invalid; allowed: "
                "integers with 1 <= probe_gap <= max_probe_gap"
            )
        self.weight = float(weight)
        self.probe_gap = probe_gap
        self.max_probe_gap = max_probe_gap
        self.plain_s = 0.0  # moving average of a pass without adapters (s)
        self.idle_s = 0.0  # of a step without draft passes, where the passes are planned (s)
        self.n_idle = 0
        self.planned = False  # whether steps report their planned passes
        self.adapted_s = 0.0  # of a pass with some adapter (s)
        self.n_plain = 0
        self.n_adapted = 0
        self.gain_tokens = 0.0  # moving average of the adapted drafts' predicted extra tokens/step
        self.n_gain = 0
        self.wanted = False  # whether the next pass applies adapters
        self.probing = False  # whether it does so as a probe (every request should get an adapter)
        self.probes = 0
        self._gap = probe_gap
        self._since_adapted = probe_gap  # the first decision after a plain pass probes

    @property
    def extra_s(self) -> float:
        """Predicted extra time of an adapted pass over a plain one (s, >= 0; 0 until both seen)."""
        if self.n_plain == 0 or self.n_adapted == 0:
            return 0.0
        return max(self.adapted_s - self.plain_s, 0.0)

    @property
    def fixed_s(self) -> float:
        """The drafter time every step pays whatever the decisions (s): where the passes are planned,
        the moving average of the steps without draft passes (0 before one is seen); otherwise that
        of a plain pass (vLLM runs the drafter in full at every step)."""
        return self.idle_s if self.planned else self.plain_s

    def observe(self, drafter_time_s: float, adapters: bool, passes: int | None = None) -> float:
        """Count one step's draft-model time of ``drafter_time_s`` seconds (``adapters``: whether it
        applied one; ``passes``: the draft passes planned for the step, None where vLLM runs them
        all). A step with ``passes == 0`` and no adapter counts toward :attr:`fixed_s` only.
        Returns its time beyond a plain pass's (s, >= 0; 0 for a plain pass, a bad time, or before a
        plain pass was seen): what the baseline would not have paid."""
        d = drafter_time_s
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d) or d <= 0:
            return 0.0
        w = self.weight
        if passes is not None:
            self.planned = True
            if passes == 0 and not adapters:
                self.idle_s = d if self.n_idle == 0 else (1 - w) * self.idle_s + w * d
                self.n_idle += 1
                return 0.0
        if adapters:
            self.adapted_s = d if self.n_adapted == 0 else (1 - w) * self.adapted_s + w * d
            self.n_adapted += 1
            return max(d - self.plain_s, 0.0) if self.n_plain else 0.0
        self.plain_s = d if self.n_plain == 0 else (1 - w) * self.plain_s + w * d
        self.n_plain += 1
        return 0.0

    def decide(
        self, gain_tokens: float | None, token_rate: float, slack_tokens: float, base_rate: float
    ) -> bool:
        """Whether the next pass applies adapters (also kept in :attr:`wanted`).

        ``gain_tokens``: this step's predicted extra tokens from adapted drafts (None when none were
        offered); ``token_rate``: what a second of step time is worth (tokens/s: the step's
        predicted goodput); ``slack_tokens``: the safety rule's slack (tokens) and ``base_rate``
        its ``(1 - alpha)`` times the baseline's goodput (tokens/s)."""
        if gain_tokens is not None and math.isfinite(gain_tokens):
            w = self.weight if self.n_gain else 1.0
            self.gain_tokens = (1 - w) * self.gain_tokens + w * max(gain_tokens, 0.0)
            self.n_gain += 1
        self._since_adapted += 1
        extra = self.extra_s
        pays = (
            self.n_plain > 0
            and self.n_gain > 0
            and self.gain_tokens > extra * max(token_rate, 0.0)
            and slack_tokens + self.gain_tokens - base_rate * extra >= 0.0
        )
        want, probe = pays, False
        if pays:
            self._gap = self.probe_gap
        elif self.n_plain > 0 and self._since_adapted >= self._gap:
            # A probe: one adapted pass to keep the adapters' acceptance and cost measured.
            want = probe = True
            self.probes += 1
            self._gap = min(2 * self._gap, self.max_probe_gap)
        if want:
            self._since_adapted = 0
        self.wanted, self.probing = want, probe
        return want

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "plain_pass_ms": round(1e3 * self.plain_s, 2),
            "fixed_ms": round(1e3 * self.fixed_s, 3),
            "adapted_pass_ms": round(1e3 * self.adapted_s, 2),
            "adapted_passes": self.n_adapted,
            "adapter_gain_tokens": round(self.gain_tokens, 3),
            "adapter_probes": self.probes,
            "adapters_next": self.wanted,
        }
