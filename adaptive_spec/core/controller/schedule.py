"""When the controller probes, rests, and shadows Jacobi (steps 5 and 6 of
:mod:`adaptive_spec.core.controller`, and its cost of weak arms)."""

from __future__ import annotations

import numpy as np

from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.protocol import StepOutcome

#: A cost probe that verifies the draft tokens predicted to be accepted with probability >= 0.25.
PROBE_SPECULATE = "speculate"
#: A cost probe that verifies no draft token, where the no-speculation cell still needs measuring.
PROBE_NOTHING = "nothing"
_FIRST_PROBE_GAP = 8  # steps before the first probe on either side (then doubling, to a cap)
_JACOBI_RECENT = 256  # steps after Jacobi last paid during which it is shadowed at full rate
# Jacobi pays while the acceptance rate of its played draft tokens (a moving average over the steps
# that play it, weight _JACOBI_RATE_WEIGHT) is at least this: about half the n-gram proposer's rate on
# the embedded default, several times Jacobi's own there.
_JACOBI_PAYS_RATE = 0.2
_JACOBI_RATE_WEIGHT = 0.1


class ProbeSchedule:
    """Counts decisions on each side of the speculate / do-not-speculate boundary, says when a cost
    probe is due (:meth:`due_probe`) and which steps rest (:meth:`rests`).

    Parameters
    ----------
    probe_every : int >= 1
        Steps in a row on one side of the boundary before a cost probe, once the interval has grown
        (it starts at 8 steps and doubles after each probe that verifies draft tokens).
    rest_after : int >= 1
        Decisions in a row that verify no draft token (probes aside) before resting.
    wake_every : int >= 1
        While resting, one step in this many decides in full (1: never rest).
    """

    def __init__(self, probe_every: int, rest_after: int, wake_every: int) -> None:
        self.probe_every = probe_every
        self.rest_after = rest_after
        self.wake_every = wake_every
        self.without_spec = 0  # decisions (and rest steps) in a row without a verified draft token
        self.with_spec = 0  # decisions in a row with some
        first = min(_FIRST_PROBE_GAP, probe_every)
        self.probe_gap = [first, first]  # without / with speculation
        self.quiet = 0  # decisions in a row that verified no draft token (probes aside)
        self.rest_count = 0  # steps that could rest since the last decision that drafted
        self.resting = False  # the coming observation is of a rest step
        self._rest_key = (-1, -1)  # (batch size, quiet // rest_after) of the last trust check
        self._rest_trusted = False
        self.rest_steps = 0

    def rests(self, batch_size: int, cost: StepCostModel) -> bool:
        """Whether the coming step is a rest step: after ``rest_after`` quiet decisions, and where
        ``cost`` prices one draft token at this batch size from measurements, all but one step in
        ``wake_every`` (and not when a cost probe is due)."""
        if self.quiet < self.rest_after or self.wake_every == 1:
            return False
        key = (batch_size, self.quiet // self.rest_after)  # checked again every rest_after steps
        if key != self._rest_key:  # the price of speculating here is measured, not guessed
            self._rest_key = key
            self._rest_trusted = cost.trusted(batch_size, 1)
        if not self._rest_trusted:
            return False
        self.rest_count += 1
        if (
            self.rest_count % self.wake_every == 0
            or self.without_spec + 1 >= self.probe_gap[0]  # a cost probe is due
        ):
            return False
        self.without_spec += 1  # rest steps count toward the next probe
        self.resting = True
        self.rest_steps += 1
        return True

    def due_probe(self, V: int, v_max: int) -> str | None:
        """Count a decision that verifies ``V`` draft tokens (of ``v_max`` offered) and say which
        cost probe is due: :data:`PROBE_SPECULATE` after ``probe_gap[0]`` decisions in a row without
        draft tokens (when any are offered), :data:`PROBE_NOTHING` after ``probe_gap[1]`` in a row
        with some (the caller plays it only where the no-speculation cell needs measuring), else
        None."""
        if V == 0:
            self.without_spec += 1
            self.with_spec = 0
            if self.without_spec >= self.probe_gap[0] and v_max > 0:
                self.without_spec = 0
                self.probe_gap[0] = min(2 * self.probe_gap[0], self.probe_every)
                return PROBE_SPECULATE
            return None
        self.with_spec += 1
        self.without_spec = 0
        if self.with_spec >= self.probe_gap[1]:
            self.with_spec = 0
            return PROBE_NOTHING
        return None

    def decided(self, V: int, probe: bool) -> None:
        """Count a decision that plays ``V`` draft tokens toward resting (a probe does not count)."""
        if not probe:
            self.quiet = self.quiet + 1 if V == 0 else 0
            if V:
                self.rest_count = 0


class JacobiShadow:
    """Which requests record the target's argmax rows that Jacobi's next draft needs: those that
    play Jacobi, and a shadow sample of one request-step in :meth:`interval` that keeps scoring it
    elsewhere.

    Parameters
    ----------
    index : int
        Jacobi's proposer index (-1: not enabled).
    shadow_every : int >= 1
        Request-steps per shadow sample while Jacobi pays.
    """

    def __init__(self, index: int, shadow_every: int) -> None:
        self.index = index
        self.shadow_every = shadow_every
        # The last step on which Jacobi paid (None: not yet) and the moving acceptance rate of its
        # played draft tokens.
        self.paid_at: int | None = None
        self.rate = 0.0

    def interval(self, n_steps: int, loaded: bool) -> int:
        """Request-steps per shadow sample of Jacobi at step ``n_steps``: ``shadow_every`` while
        Jacobi paid in the last 256 steps (the moving acceptance rate of its played draft tokens was
        at least 0.2), and during the first 256 steps when nothing is known about it (``loaded``
        False: no shipped prior or loaded state scored it; on a model without a prior, Jacobi may be
        what drafts where nothing else does); else 8 times that (a weak arm costs little). Being
        played, or a lucky accepted token, is not enough: the allocation plays a shadow guess where
        it is a request's only draft, and on the embedded default about one Jacobi draft token in
        20-50 is accepted, which would keep the full rate on for good."""
        if self.paid_at is None:
            recent = n_steps <= _JACOBI_RECENT and not loaded
        else:
            recent = n_steps - self.paid_at <= _JACOBI_RECENT
        return self.shadow_every if recent else 8 * self.shadow_every

    def guess_wanted(self, slots: list[int | None], n_steps: int, loaded: bool) -> list[bool]:
        """Per request (``slots``: its slot, None for one not tracked), whether Jacobi drafts its
        initial guess now: on the shadow schedule, so that Jacobi keeps being scored where nothing
        else verifies."""
        if self.index < 0:
            return [False] * len(slots)
        every = self.interval(n_steps, loaded)
        return [s is not None and (s + n_steps) % every == 0 for s in slots]

    def argmax_wanted(
        self, played: list[list[int]], slots: np.ndarray, n_steps: int, loaded: bool, probe: bool
    ) -> tuple[list[bool] | None, bool]:
        """Per request, whether the engine records its target argmax rows for Jacobi's next draft
        (``played``: ``[proposer index, k]`` per request; ``slots`` int64 [N]: their slots): where
        it plays Jacobi now (its iterate goes on), and on the shadow schedule. Also whether the
        decision plays Jacobi (a cost probe is no sign that it pays). ``(None, False)`` when Jacobi
        is not enabled."""
        if self.index < 0:
            return None, False
        every = self.interval(n_steps, loaded)
        plays = [c == self.index and k > 0 for c, k in played]
        wanted = [
            p or (s + n_steps) % every == 0 for s, p in zip(slots.tolist(), plays, strict=True)
        ]
        return wanted, not probe and any(plays)

    def observe(self, outcome: StepOutcome, step: int) -> None:
        """Update Jacobi's moving acceptance rate from a step that played it; it pays while the rate
        is at least 0.2."""
        drafted = accepted = 0
        for o in outcome.requests:
            if o.drafted > 0 and o.arm.proposer == "jacobi":
                drafted += o.drafted
                accepted += o.accepted
        if drafted:
            self.rate += _JACOBI_RATE_WEIGHT * (accepted / drafted - self.rate)
            if self.rate >= _JACOBI_PAYS_RATE:
                self.paid_at = step
