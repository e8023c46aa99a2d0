"""How many passes the engine's drafter (a draft model or an EAGLE head) runs at the next step.

vLLM's drafter runs ``num_speculative_tokens`` passes for every request at every step unless told
otherwise through ``SchedulerOutput.num_spec_tokens_to_schedule``; with a controller that keeps few of
those drafts most of that work is wasted. Drafts made at step ``t`` are verified at ``t + 1``, and the
number of passes at ``t`` is fixed when ``t`` is scheduled, before the controller has seen step ``t``'s
outcome: the plan is therefore made from the last decision.

:class:`DrafterPasses` plans ``max`` over the requests of the drafter arm's chosen ``k``, and 0 when no
request drafts with the drafter (vLLM then runs only the pass that keeps the drafter's KV cache
current). A policy can only choose among the drafts offered, so the plan also probes: every
``grow_every`` steps in which some request took every drafter draft offered, the next step drafts in
full (the policy may want longer chains); and while the plan is 0, a probe every ``gap`` steps at the
k last used (in full before any use), so that the policy sees the drafter's drafts again. The gap
doubles after each probe nobody used, up to ``max_gap``, and resets when a request drafts again.
"""

from __future__ import annotations

from collections.abc import Sequence


class DrafterPasses:
    """The drafter's next number of passes (see the module docstring).

    Parameters
    ----------
    max_k : int >= 1
        The most passes: the engine's ``num_speculative_tokens``, or less where the policy never
        takes more (:meth:`~adaptive_spec.core.protocol.SpecPolicy.drafter_k_cap`).
    gap, max_gap : int
        Steps between probes (at the k last used) while no request uses the drafter: starts at
        ``gap``, doubles after each unused probe, at most ``max_gap``.
    grow_every : int
        Steps, among those where some request took every drafter draft offered, between full-length
        probes.

    Raises
    ------
    ValueError
        For ``max_k < 1`` or gaps that are not integers with ``1 <= gap <= max_gap``.
    """

    def __init__(self, max_k: int, gap: int = 8, max_gap: int = 128, grow_every: int = 8) -> None:
        if not (isinstance(max_k, int) and max_k >= 1):
            raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 1")
        if not (isinstance(gap, int) and isinstance(max_gap, int) and 1 <= gap <= max_gap):
            raise ValueError(
                f"gap={gap!r}, max_gap={max_gap!r} are invalid; allowed: integers with "
                "1 <= gap <= max_gap"
            )
        if not (isinstance(grow_every, int) and grow_every >= 1):
            raise ValueError(f"grow_every={grow_every!r} is invalid; allowed: an integer >= 1")
        self.max_k = max_k
        self.grow_every = grow_every
        self.full = (
            0  # steps since the last full-length pass, among those whose drafts were all used
        )
        self.first_gap = gap
        self.max_gap = max_gap
        self.gap = gap
        self.next = max_k  # the first step drafts in full, so the policy sees the drafter
        self.last = max_k  # the largest k last taken from the drafter: the length of idle probes
        self.idle = 0
        self.probing = False
        self.passes = 0  # passes planned over the run (what vLLM ran, with the probes)
        self.steps = 0
        self.probes = 0

    def plan(self, chosen: Sequence[int], offered: Sequence[int]) -> int:
        """The passes of the next step, from the last decision.

        Parameters
        ----------
        chosen : sequence of int
            Per request decided, its drafter draft length (0 where it verifies no drafter drafts).
        offered : sequence of int
            Per request, the drafter drafts offered to that decision (what the last pass count gave).

        Returns
        -------
        int
            Passes in ``0..max_k``.
        """
        used = [(c, o) for c, o in zip(chosen, offered, strict=True) if c > 0]
        if used:
            want = self.last = max(c for c, _ in used)
            self.idle, self.gap, self.probing = 0, self.first_gap, False
            if any(c >= o for c, o in used):
                self.full += 1
                if self.full >= self.grow_every and want < self.max_k:
                    want, self.full = self.max_k, 0
                    self.probes += 1
        else:
            want = 0
            if self.probing:  # a probe nobody used: wait longer for the next
                self.gap = min(self.gap * 2, self.max_gap)
                self.probing = False
            self.idle += 1
            if self.idle >= self.gap:
                want, self.idle, self.probing = self.last, 0, True
                self.probes += 1
        self.next = want
        self.passes += want
        self.steps += 1
        return want

    def as_dict(self) -> dict[str, float]:
        """Planned passes per step and probes so far."""
        return {
            "steps": self.steps,
            "mean_passes": round(self.passes / self.steps, 4) if self.steps else 0.0,
            "probes": self.probes,
        }


def passes_not_in_baseline(drafter_time_s: float, passes: int | None, baseline_k: int) -> float:
    """The drafter time (s) of a step's draft passes that a baseline drafting ``baseline_k`` tokens with
    the drafter (0 when it does not draft with it) would not have run: the passes beyond its k, each
    priced at the step's drafter time over its passes plus the one that keeps the drafter's KV cache
    current. 0 where the passes are not planned (``passes`` None or 0)."""
    if not passes or drafter_time_s <= 0:
        return 0.0
    return drafter_time_s * max(passes - baseline_k, 0) / (passes + 1)
