"""The adaptive controller: per request and per step, which proposer drafts and how many tokens (k).

One step, as :meth:`AdaptiveController.decide` computes it for a batch of ``N`` requests and ``P``
proposers (all of it vectorised over the batch):

1. **Acceptance** (:class:`~adaptive_spec.core.acceptance.AcceptanceModel`): per request and proposer, the
   conditional acceptance ``alpha_j`` of each draft position from its context cell (temperature,
   the request's own acceptance history with that proposer, the proposer's match feature); the
   expected gain of draft token ``j`` is ``prod_{i <= j} alpha_i`` (the probability it is accepted).
2. **Proposer per request**: the one maximising ``E[tokens](c) - lambda * c`` over its offered
   lengths ``c``, where ``lambda`` (tokens per draft token) is the marginal value of a draft token at
   the previous step's optimum (the allocation's Lagrange multiplier).
3. **Allocation** (SmartSpec's goodput, Liu et al. 2024, with DSpark-style top-B slots over a measured
   table): the chosen proposers' gains of every request and position are sorted, and the batch takes
   the prefix of ``V`` draft tokens that maximises predicted goodput
   ``(N + sum of the V best gains) / t(B, V)``, with ``t`` the measured step-cost table
   (:class:`~adaptive_spec.core.cost_model.StepCostModel`), which charges the fixed cost of speculating at
   all at ``V = 1`` and, for the share of requests that sample (temperature > 0), the table's sampled
   part (verification costs more there). Because a request's gains fall with position, the prefix is
   a per-request k. With ``speculation_premium > 0`` (default 0) the allocation prices speculation at
   ``1 + speculation_premium`` times what the table adds to a step: a committed token is worth a
   full share of the step only while queued requests refill the batch (in a finite batch, or below
   saturation, the batch shrinks instead). The safety rule's slack is then spent on drafting less
   than its model's optimum, so its bound can be exceeded by the model's error
   (``docs/replay.md``).
   **A draining batch** (no request waits: the last requests of an offline batch such as
   ``LLM.generate``) ends when its request with the largest remaining budget (``max_tokens`` minus
   the tokens emitted) ends, and a token committed elsewhere no longer frees a slot for a waiting
   request. There the objective counts only the ``W`` requests within ``drain_margin`` tokens of that
   budget, ``(W + sum of their V best gains) / t(B, V)``: draft tokens go to the requests that decide
   when the batch ends, and the others' are not verified (the step is cheaper). Their progress
   equalises the remaining budgets, so the set moves between requests as they catch up.
4. **Safety** (:mod:`adaptive_spec.core.safety`): the baseline's decision (by default an n-gram
   batch-size table, as vLLM's ``num_speculative_tokens_per_batch_size``) is computed too; the
   controller plays its own decision only if a lower bound on its tokens and an upper bound on its
   time keep the run's cumulative goodput >= ``(1 - alpha)`` x the baseline's on the same steps,
   measured counterfactually. Otherwise it plays the baseline's.
5. **Cost probes**: after ``probe_every`` steps in a row without a verified draft token, one step
   verifies the draft tokens predicted to be accepted with probability >= 0.25 (at least one, at
   most ``max(4, N / 4)``; the interval starts at 8 steps and doubles after each probe up to
   ``probe_every``). After 8 steps in a row with some, one step verifies none while this engine's
   steps have filled the table's no-speculation cell at this batch size fewer than
   ``prior_weight`` times (:meth:`~adaptive_spec.core.cost_model.StepCostModel.observed`), whatever the
   shipped or calibrated table says, and the decision's predicted goodput is within 15 % of the
   step's without draft tokens: the price of speculating at all is the difference between that
   cell and the others, it decides near that boundary, and it depends on the workload (a batch
   whose contexts differ in length verifies draft tokens at a higher price than the dummy requests
   of a calibration). The table's
   shape is corrected only where steps are observed, so both sides of the speculate /
   do-not-speculate boundary keep being measured and a wrong table cannot switch speculation off
   for good. Probes bypass the safety rule; their cost is at most one step in 8 (at most
   ``prior_weight`` such steps per batch size) and is counted in the run's measured goodput like any
   other step.
6. **Rest steps**: after ``rest_after`` decisions in a row that verify no draft token (probes aside),
   and where the table's price of one draft token at this batch size is backed by measurements (a
   table that is only a guess keeps being probed and learned at full rate), the controller rests
   (:meth:`AdaptiveController.rests`): on ``wake_every - 1`` of every ``wake_every`` steps the step
   driver runs no proposer and no decision, every request plays ``none``, and
   :meth:`~AdaptiveController.observe` only updates the cost model and gives the safety rule's
   tracker the committed tokens (rest steps also count toward the next cost probe). Every ``wake_every``-th step decides
   in full (scoring the proposers, the safety rule, the probes); the first one that verifies a draft
   token ends the rest. When nothing pays (high temperature, high load) the controller so costs
   about what a static arm costs, and a regime change is seen within ``wake_every`` steps.

Learning (:meth:`AdaptiveController.observe`): every proposer's full draft offered at decision time is
scored against the tokens the target committed (censored per-position labels: full-information
updates for deterministic proposers whether chosen or not, cf. HedgeSpec / "Not-a-Bandit", ICLR 2026);
the step time updates the cost model's load factor and table; the baseline's counterfactual tokens are
resolved as the committed tokens arrive.

Weak arms cost little: Jacobi drafts need the target's argmax at verified positions, so the controller
asks the engine for those rows (``Decision.argmax_wanted``) only for the requests that play Jacobi now
(their iterate goes on), plus a shadow sample of one request-step in ``shadow_every`` that keeps
scoring it elsewhere (one in ``8 * shadow_every`` once Jacobi has not paid for 256 steps, i.e. the
moving acceptance rate of its played draft tokens stayed below 0.2, and from the start when a shipped
prior or a loaded state already scored it: the rows cost about 0.2-0.5 ms of bfloat16 argmax over the
vocabulary on 2 CPU cores, and Jacobi's own drafting about 0.05 ms per request).
Jacobi drafts exist only where such rows were recorded.

A draft model's pass (engines built with one) is priced apart from the step-cost table
(:mod:`adaptive_spec.core.drafter_cost`): the table and its load factor learn from the step minus that
pass, and the predicted step time adds the plain pass's moving average. LoRA adapters make the pass
cost more, so the next pass applies them only while their predicted extra tokens pay for that and
the safety rule's slack covers it (with budgeted probes), and the baseline is never charged their
extra time.

The package: :mod:`.adaptive` (the :class:`AdaptiveController` class: decide, observe, reports,
state), :mod:`.records` (a step's batch, the pending decision, the committed rows), :mod:`.schedule`
(cost probes, rest steps, Jacobi's shadow samples), :mod:`.slots` (per-request slots and histories),
:mod:`.choices` (probes' draft tokens, epsilon-greedy arms, the adapters' worth, logged features),
:mod:`.reports` (calibration) and :mod:`.settings` (parameter ranges). The per-step arithmetic is
compiled (:mod:`adaptive_spec.core.controller_kernels`).
"""

from __future__ import annotations

from adaptive_spec.core.protocol import Decision, SpecPolicy, StepOutcome, StepView

from .adaptive import AdaptiveController
from .choices import DECISION_FEATURES
from .settings import EXPLORATION_MODES

__all__ = [
    "DECISION_FEATURES",
    "EXPLORATION_MODES",
    "AdaptiveController",
    "Decision",
    "SpecPolicy",
    "StepOutcome",
    "StepView",
]
