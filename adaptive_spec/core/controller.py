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
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from adaptive_spec.core import controller_kernels as kern
from adaptive_spec.core.acceptance import (
    HIST_EDGES,
    N_HIST,
    N_MATCH,
    N_TEMP,
    AcceptanceModel,
    history_bucket,
    match_thresholds,
)
from adaptive_spec.core.arms import NO_SPEC, Arm
from adaptive_spec.core.baselines import BatchSizeTablePolicy, StaticPolicy, default_baseline
from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.drafter_cost import DrafterCost
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepOutcome, StepView
from adaptive_spec.core.safety import BaselineTracker, ConservativeGuard

EXPLORATION_MODES = ("greedy", "ucb", "thompson", "eps-greedy")
#: Logged per request in the trace (``Decision.features``), in this order.
DECISION_FEATURES = (
    "temperature_bucket",
    "history_bucket",  # of the chosen proposer (or of the best one when k = 0)
    "match_bucket",
    "expected_tokens",  # predicted tokens committed with the played arm
    "played_baseline",  # 1 when the safety rule played the baseline's decision
)
_NO_TOKENS = np.zeros(0, dtype=np.int64)
# A no-speculation cost probe only while the decision's predicted goodput is below (1 + this) x the
# step's without draft tokens: beyond it, an error in that cell's price changes nothing.
_PROBE_ADVANTAGE = 0.15
_JACOBI_RECENT = 256  # steps after Jacobi last paid during which it is shadowed at full rate
# Jacobi pays while the acceptance rate of its played draft tokens (a moving average over the steps
# that play it, weight _JACOBI_RATE_WEIGHT) is at least this: about half the n-gram proposer's rate on
# the embedded default, several times Jacobi's own there.
_JACOBI_PAYS_RATE = 0.2
_JACOBI_RATE_WEIGHT = 0.1


def _flatten(
    outcome: StepOutcome, index: dict[str, int]
) -> tuple[list[int], list[int], list[int], list[int], list[str]]:
    """The outcome's requests found in ``index`` (request id -> row or slot): their ``index`` values,
    their committed-token counts, those tokens one after another, and the values of the finished
    ones; then the ids of every finished request of the outcome (found or not)."""
    keys: list[int] = []
    lens: list[int] = []
    flat: list[int] = []
    finished: list[int] = []
    done: list[str] = []
    for o in outcome.requests:
        if o.finished:
            done.append(o.req_id)
        i = index.get(o.req_id)
        if i is None:
            continue
        em = o.emitted_token_ids
        keys.append(i)
        lens.append(len(em))
        flat.extend(em)
        if o.finished:
            finished.append(i)
    return keys, lens, flat, finished, done


class AdaptiveController(SpecPolicy):
    """The default controller (see the module docstring).

    Parameters
    ----------
    proposers : list of str
        Proposers it may choose from (``none`` is always allowed).
    max_k : int >= 1
        Largest k (the engine's ``num_speculative_tokens``).
    baseline : str, StaticPolicy or BatchSizeTablePolicy, optional
        The safe baseline: ``none``, ``static:<proposer>:<k>``, ``table:<proposer>:<s>-<e>=<k>,...``
        or such a policy object. Default: :func:`~adaptive_spec.core.baselines.default_baseline` (an n-gram
        batch-size table when ``ngram`` is enabled, else ``none``).
    alpha : float in [0, 1)
        Allowed shortfall against the baseline (0.02: cumulative goodput >= 0.98 x the baseline's).
        1 - alpha close to 0 disables the safety rule in effect.
    cost_table : StepCostTable, optional
        The measured step-cost table (default: a generic prior shape, corrected online).
    exploration : {"greedy", "ucb", "thompson", "eps-greedy"}
        How acceptance uncertainty drives choices: posterior means (default; deterministic proposers
        are scored on every step whether chosen or not, so they need no exploration), an upper
        confidence bound of ``ucb_bonus`` standard deviations, one Thompson draw per context cell
        per step, or posterior means with a uniformly random arm per request with probability
        ``epsilon`` (the only mode whose propensities are exact for off-policy evaluation).
    epsilon : float in [0, 1]
    ucb_bonus : float >= 0
    discount : float in (0, 1]
        Forgetting of the acceptance counts per step.
    ema : float in (0, 1]
        Weight of the newest step in a request's acceptance history.
    probe_every : int >= 1
        Steps in a row on one side of the speculate / do-not-speculate boundary before a cost probe.
    shadow_every : int >= 1
        A weak proposer (Jacobi) is scored on one request-step in this many (in 8 times as many once it
        has not been played for 256 steps, or from the start when a loaded prior or state scored it).
    rest_after : int >= 1
        Decisions in a row that verify no draft token (probes aside) before the controller rests.
    wake_every : int >= 1
        While resting, one step in this many decides in full (1: never rest).
    speculation_premium : float >= 0
        The allocation prices speculation at ``1 + speculation_premium`` times what the cost table
        says it adds to a step (step 3 of the module docstring); the safety rule and the cost model
        use the table's own times.
    drain_margin : int >= 0, "auto" or None
        While no request waits, the allocation counts only the requests within this many tokens of
        the largest remaining budget (step 3 of the module docstring: the batch drains, and it ends
        with its longest request). "auto": ``2 * (max_k + 1)``, what two steps can commit (a request
        that close may still finish last; a smaller margin leaves requests that are about to become
        the last ones without drafts). None: per-step goodput always, as a server should use (its
        queue empties between arrivals and every request's latency counts).
    seed : int >= 0
        Seeds the random draws (Thompson, epsilon-greedy).

    Raises
    ------
    ValueError
        For an unknown proposer, exploration mode or baseline, or a parameter outside its range.
    """

    name = "adaptive"
    wants_jacobi_guess = False  # the guess only on the shadow schedule (jacobi_guess_wanted)

    def __init__(
        self,
        proposers: list[str],
        max_k: int,
        *,
        baseline: str | SpecPolicy | None = None,
        alpha: float = 0.02,
        cost_table: StepCostTable | None = None,
        exploration: str = "greedy",
        epsilon: float = 0.05,
        ucb_bonus: float = 1.0,
        discount: float = 0.9995,
        ema: float = 0.3,
        probe_every: int = 64,
        shadow_every: int = 16,
        rest_after: int = 16,
        wake_every: int = 4,
        speculation_premium: float = 0.0,
        drain_margin: int | str | None = "auto",
        seed: int = 0,
    ) -> None:
        super().__init__(proposers, max_k)
        if max_k < 1:
            raise ValueError(f"max_k={max_k!r} is invalid; allowed: an integer >= 1")
        if exploration not in EXPLORATION_MODES:
            raise ValueError(
                f"exploration={exploration!r} is not known; allowed: {', '.join(EXPLORATION_MODES)}"
            )
        if not (isinstance(epsilon, int | float) and 0.0 <= epsilon <= 1.0):
            raise ValueError(f"epsilon={epsilon!r} is invalid; allowed: 0 <= epsilon <= 1")
        for name, v in (("ema", ema), ("discount", discount)):
            if not (isinstance(v, int | float) and 0.0 < v <= 1.0):
                raise ValueError(f"{name}={v!r} is invalid; allowed: 0 < {name} <= 1")
        if not (isinstance(ucb_bonus, int | float) and math.isfinite(ucb_bonus) and ucb_bonus >= 0):
            raise ValueError(f"ucb_bonus={ucb_bonus!r} is invalid; allowed: a finite number >= 0")
        for name, v in (
            ("probe_every", probe_every),
            ("shadow_every", shadow_every),
            ("rest_after", rest_after),
            ("wake_every", wake_every),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; allowed: an integer >= 1")
        if not (
            isinstance(speculation_premium, int | float)
            and not isinstance(speculation_premium, bool)
            and math.isfinite(speculation_premium)
            and speculation_premium >= 0
        ):
            raise ValueError(
                f"speculation_premium={speculation_premium!r} is invalid; allowed: a finite "
                "number >= 0 (0: price speculation at the cost table's time)"
            )
        if drain_margin == "auto":
            drain_margin = 2 * (max_k + 1)
        elif drain_margin is not None and (
            isinstance(drain_margin, bool) or not isinstance(drain_margin, int) or drain_margin < 0
        ):
            raise ValueError(
                f"drain_margin={drain_margin!r} is invalid; allowed: an integer >= 0, 'auto' (two "
                "steps' worth of tokens, 2 * (max_k + 1)) or None (per-step goodput also while the "
                "batch drains)"
            )
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid; allowed: an integer >= 0")
        kern.warm_up()  # the per-step kernels' machine code, loaded before the first step
        self.exploration = exploration
        self.epsilon = float(epsilon)
        self.ucb_bonus = float(ucb_bonus)
        self.ema_weight = float(ema)
        self.probe_every = probe_every
        self.shadow_every = shadow_every
        self.rest_after = rest_after
        self.wake_every = wake_every
        self.speculation_premium = float(speculation_premium)
        self.drain_margin = drain_margin
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        self.acceptance = AcceptanceModel(self.proposers, max_k, discount=discount)
        self.cost = StepCostModel(cost_table)
        self.guard = ConservativeGuard(alpha)
        self.tracker = BaselineTracker(max_k)
        self._set_baseline(baseline)
        P = len(self.proposers)
        self._pidx = {p: i for i, p in enumerate(self.proposers)}
        self._thresholds = np.array([match_thresholds(p) for p in self.proposers]).reshape(P, 3)
        self._jacobi = self._pidx.get("jacobi", -1)
        self._prange = np.arange(P)
        # Match bucket of every (proposer, match feature 0..63): one lookup per step.
        feat = np.arange(64)
        self._match_lut = np.minimum(
            (feat[None, :, None] >= self._thresholds[:, None, :]).sum(axis=2), N_MATCH - 1
        ).astype(np.int64)
        self._jpos = np.arange(max_k)
        self._jpos1 = self._jpos + 1
        self._no_table = np.zeros((0, max_k))
        self._rows_cache = np.arange(64)
        # Arm objects by (proposer index, k); row -1 (the last) is "none" for every k.
        self._arm_table = [
            [NO_SPEC] + [Arm(p, k) for k in range(1, max_k + 1)] for p in self.proposers
        ]
        self._arm_table.append([NO_SPEC] * (max_k + 1))
        self._base_index = self._pidx.get(self._base_proposer, -1) if self._base_proposer else -1
        # LoRA-adapted drafts: their drafter pass costs more than a plain one (DrafterCost).
        self._adapted = np.array([p.startswith("lora:") for p in self.proposers], dtype=bool)
        self._has_adapted = bool(self._adapted.any())
        self.drafter = DrafterCost()
        # Per-request slots.
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        # The last step on which Jacobi paid (None: not yet) and the moving acceptance rate of its
        # played draft tokens (see _shadow_interval).
        self._jacobi_paid_at: int | None = None
        self._jacobi_rate = 0.0
        self._last_ids: list[str] | None = None  # the last decision's requests and their slots
        self._last_slots = np.zeros(0, dtype=np.int64)
        self._hist_rate = np.zeros((16, P))
        self._hist_n = np.zeros((16, P))
        self._hist_b = np.zeros((16, P), dtype=np.int64)  # history bucket, kept up to date
        # The last decision's per-request arrays, written by decide_step and read by observe_step.
        self._buf = kern.StepBuffers(P, max_k)
        # The last decision, kept for observe (per row of the decided batch).
        self._pending: dict[str, Any] | None = None
        self._lam = 0.0
        self._steps_without_spec = 0
        self._steps_with_spec = 0
        self._probe_gap = [min(8, probe_every), min(8, probe_every)]  # without / with speculation
        self._quiet = 0  # decisions in a row that verified no draft token (probes aside)
        self._rest_count = 0  # steps that could rest since the last decision that drafted
        self._resting = False  # the coming observation is of a rest step
        self._rest_key = (-1, -1)  # (batch size, quiet // rest_after) of the last trust check
        self._rest_trusted = False
        self.rest_steps = 0
        self.log_features = False
        # Calibration report (replay --calibration): (proposer, position, predicted, accepted) arrays.
        self.record_calibration = False
        self.calibration_records: list[tuple[np.ndarray, ...]] = []
        self.n_steps = 0

    # -- baseline ---------------------------------------------------------------------------------
    def _set_baseline(self, baseline: str | SpecPolicy | None) -> None:
        if baseline is None:
            baseline = default_baseline(self.proposers, self.max_k)
        if isinstance(baseline, str):
            from adaptive_spec.core.policies import make_policy

            try:
                baseline = make_policy(baseline, ["none", *self.proposers], self.max_k)
            except ValueError as e:
                raise ValueError(f"baseline={baseline!r} is invalid: {e}") from None
        if isinstance(baseline, StaticPolicy):
            arm = baseline.arm
            self._base_proposer = arm.proposer if arm.k else None
            self._base_table = [[1, 1 << 30, arm.k]]
        elif isinstance(baseline, BatchSizeTablePolicy):
            self._base_proposer = baseline.proposer
            self._base_table = [list(r) for r in baseline.table]
        else:
            raise ValueError(
                f"baseline={baseline!r} is invalid; allowed: none, static:<proposer>:<k>, "
                "table:<proposer>:<start>-<end>=<k>,... (a proposer this controller enables)"
            )
        if self._base_proposer is not None and self._base_proposer not in self.proposers:
            raise ValueError(
                f"baseline proposer {self._base_proposer!r} is not enabled; enabled: "
                f"{', '.join(self.proposers) or 'none'}"
            )
        self.baseline_name = baseline.name if self._base_proposer else "none"

    def baseline_k(self, batch_size: int) -> int:
        """The baseline's k at ``batch_size`` (0 outside every table row)."""
        for start, end, k in self._base_table:
            if start <= batch_size <= end:
                return min(int(k), self.max_k)
        return 0

    # -- per-request slots --------------------------------------------------------------------------
    def _slots(self, req_ids: list[str], positions: np.ndarray) -> np.ndarray:
        """Each request's slot (int64 [N]); the decision checks that the slots are in step with
        ``positions`` (:meth:`decide`)."""
        if req_ids == self._last_ids:  # the same batch as the last decision: its slots
            return self._last_slots
        out = self._assign_slots(req_ids, positions)
        self._last_ids, self._last_slots = req_ids, out
        return out

    def _assign_slots(self, req_ids: list[str], positions: np.ndarray) -> np.ndarray:
        """Each request's slot, a free one (with cleared history) for a request seen first."""
        out = np.empty(len(req_ids), dtype=np.int64)
        slot = self._slot
        for i, rid in enumerate(req_ids):
            s = slot.get(rid)
            if s is None:
                s = self._free.pop() if self._free else len(slot)
                slot[rid] = s
                if s >= self._hist_rate.shape[0]:
                    grow = max(2 * self._hist_rate.shape[0], s + 1)
                    for name in ("_hist_rate", "_hist_n", "_hist_b"):
                        old = getattr(self, name)
                        new = np.zeros((grow, old.shape[1]), dtype=old.dtype)
                        new[: old.shape[0]] = old
                        setattr(self, name, new)
                self._hist_rate[s] = 0.0
                self._hist_n[s] = 0.0
                self._hist_b[s] = 0
                self.tracker.reset_slot(s, int(positions[i]))
            out[i] = s
        self.tracker.ensure(int(out.max()) + 1 if len(out) else 0)
        return out

    def release(self, req_id: str) -> None:
        s = self._slot.pop(req_id, None)
        self._last_ids = None
        pend = self._pending
        if pend is not None and req_id in pend["index"]:
            # Released between its decision and the observation (an abort): the baseline's draft
            # of it would never be resolved, so it is not registered.
            row = pend["index"][req_id]
            self._buf.ints[row, self._buf.c_ks] = 0
            self._buf.ints[row, self._buf.c_kb] = 0
        if s is not None:
            self.tracker.reset_slot(s, 0)
            self._free.append(s)

    def num_tracked_requests(self) -> int:
        return len(self._slot)

    # -- decision -----------------------------------------------------------------------------------
    def rests(self, batch_size: int) -> bool:
        """Whether the coming step is a rest step (step 6 of the module docstring): after
        ``rest_after`` quiet decisions, all but one step in ``wake_every``."""
        if self._quiet < self.rest_after or self.wake_every == 1:
            return False
        key = (batch_size, self._quiet // self.rest_after)  # checked again every rest_after steps
        if key != self._rest_key:  # the price of speculating here is measured, not guessed
            self._rest_key = key
            self._rest_trusted = self.cost.trusted(batch_size, 1)
        if not self._rest_trusted:
            return False
        self._rest_count += 1
        if (
            self._rest_count % self.wake_every == 0
            or self._steps_without_spec + 1 >= self._probe_gap[0]  # a cost probe is due
        ):
            return False
        self._steps_without_spec += 1  # rest steps count toward the next probe
        self._resting = True
        self.rest_steps += 1
        return True

    def _alpha_table(self) -> np.ndarray:
        """The conditional acceptance table the decision scores with, float64 [cells, max_k]; an
        empty one (greedy exploration) lets the decision kernel take the posterior means of the
        counts itself (no separate call on the per-step path)."""
        if self.exploration == "thompson":
            return self.acceptance.sample(self.rng)
        if self.exploration == "ucb":
            return self.acceptance.optimistic(self.ucb_bonus)
        return self._no_table

    def decide(self, view: StepView) -> Decision:
        reqs = view.requests
        N = len(reqs)
        K = self.max_k
        P = len(self.proposers)
        if N == 0 or P == 0:
            self._pending = None
            self.n_steps += 1
            return Decision([NO_SPEC] * N, [1.0] * N, [[] for _ in range(N)])
        props = self.proposers
        # One pass over the requests: scalars, and every offered draft flattened (row-major i, p).
        req_ids: list[str] = [""] * N
        pos_l = [0] * N
        cap_l = [0] * N
        temp_l = [0] * N
        dlen = [0] * (N * P)
        mlen = [0] * (N * P)
        parts: list[np.ndarray] = []
        j = 0
        for i, r in enumerate(reqs):
            req_ids[i] = r.req_id
            pos_l[i] = r.num_output_tokens
            cap_l[i] = r.max_new_tokens
            temp_l[i] = 1 if r.temperature > 0 else 0
            dd = r.drafts
            if dd:
                for p in props:
                    d = dd.get(p)
                    if d is not None:
                        n = len(d)
                        if n:
                            if n > K:
                                d, n = d[:K], K
                            dlen[j] = n
                            parts.append(d)
                            mlen[j] = r.match_lengths.get(p, 0)
                    j += 1
            else:
                j += P
        ints = np.array(pos_l + cap_l + temp_l + dlen + mlen, dtype=np.int64)
        pos = ints[:N]
        flat = np.concatenate(parts).astype(np.int64, copy=False) if parts else _NO_TOKENS
        slots = self._slots(req_ids, pos)
        # The share of requests that sample: their verification costs more (the sampled table).
        sampled = sum(temp_l) / N
        B = view.batch_size
        curve_g, curve_s, mix = self.cost.part_curves(max(B, N), N * K, sampled)
        # A draft model's pass (0 on other engines) is a fixed part of every step, outside the table
        # and its load factor: added to both curves so that the kernel's load * curve includes it.
        c_draft = self.drafter.plain_s
        if c_draft > 0.0:
            off, same_part = c_draft / self.cost.load, curve_s is curve_g
            curve_g = curve_g + off
            curve_s = curve_g if same_part else curve_s + off
        tracker = self.tracker
        bp = self._base_index
        kbase = self.baseline_k(B) if bp >= 0 else 0
        acc = self.acceptance
        buf = self._buf
        buf.ensure(N)
        (
            v_max,
            V,
            lam,
            Vb,
            same,
            e_ctrl,
            var_ctrl,
            e_base,
            t_pred,
            tb_pred,
            n_stale,
        ) = kern.decide_step(
            flat,
            ints,
            slots,
            self._hist_b,
            self._match_lut,
            self._alpha_table(),
            acc.counts4,
            self._lam,
            P,
            K,
            N_TEMP,
            N_HIST,
            N_MATCH,
            curve_g,
            curve_s,
            mix,
            self.cost.load,
            kbase,
            bp,
            tracker.length,
            self.speculation_premium,
            -1 if self.drain_margin is None or view.queue_len > 0 else self.drain_margin,
            buf.drafts,
            buf.alpha,
            buf.g,
            buf.ints,
        )
        bi = buf.ints
        if n_stale:  # a step we did not observe: resynchronise those requests
            stale = tracker.length[slots] != pos
            for i in np.flatnonzero(stale).tolist():
                tracker.reset_slot(int(slots[i]), int(pos[i]))
        # What the controller's own decision gains from LoRA-adapted drafts (before the safety rule,
        # which may play the baseline's: the adapters' worth is the decision's, not the baseline's).
        adapter_gain = self._adapter_gain(N, P, buf) if self._has_adapted else None
        # The safety rule: the baseline's decision when a deviation could break the constraint.
        played_base = False
        probe = False
        if not same:
            if math.isnan(tb_pred):
                tb_pred = self.cost.at(B, Vb, sampled) + c_draft
            lcb = max(float(N), e_ctrl - 2.0 * math.sqrt(var_ctrl))
            ucb_t = t_pred * math.exp(2.0 * self.cost.abs_log_residual)
            if not self.guard.allows(lcb, ucb_t, e_base / max(tb_pred, 1e-9)):
                bi[:N, buf.c_ks] = bi[:N, buf.c_kb]
                bi[:N, buf.c_played] = bp
                played_base, V = True, Vb
        # Cost probes: the table is only corrected where steps are observed, so neither side of the
        # speculate / do-not-speculate boundary may go unmeasured for long; the interval starts at
        # 8 steps and doubles after each probe up to probe_every.
        if V == 0:
            self._steps_without_spec += 1
            self._steps_with_spec = 0
            if self._steps_without_spec >= self._probe_gap[0] and v_max > 0:
                bi[:N, buf.c_ks] = self._probe(buf.g[:N])
                bi[:N, buf.c_played] = bi[:N, buf.c_choice]
                probe = True
                self._steps_without_spec = 0
                self._probe_gap[0] = min(2 * self._probe_gap[0], self.probe_every)
        else:
            self._steps_with_spec += 1
            self._steps_without_spec = 0
            if self._steps_with_spec >= self._probe_gap[1]:
                self._steps_with_spec = 0
                # The no-speculation cell is measured on this engine at every batch size it runs
                # at, whatever the table says (the price of speculating at all is its difference),
                # where that price decides: while speculation's predicted advantage is small.
                if (
                    self.cost.observed(B, 0) < self.cost.prior_weight
                    and e_ctrl * (self.cost.at(B, 0, sampled) + c_draft)
                    < (1.0 + _PROBE_ADVANTAGE) * N * t_pred
                ):
                    bi[:N, buf.c_ks] = 0
                    probe = True
        if probe:
            self.guard.probes += 1
        else:
            self._quiet = self._quiet + 1 if V == 0 else 0
            if V:
                self._rest_count = 0
        self._lam = lam
        if self._has_adapted:
            # Whether the drafter's next pass applies LoRA adapters (adaptive_spec.core.drafter_cost).
            fallback = e_base / max(tb_pred, 1e-9) if not math.isnan(tb_pred) else 0.0
            self.drafter.decide(
                adapter_gain,
                e_ctrl / t_pred if t_pred > 0 else 0.0,
                self.guard.slack(fallback),
                (1.0 - self.guard.alpha) * self.guard.baseline_goodput(fallback),
            )
        table = self._arm_table
        # (played proposer, played k) per request: adjacent columns, one conversion.
        played = bi[:N, buf.c_played : buf.c_ks + 1].tolist()
        arms: list[Arm] = [table[c][k] for c, k in played]
        propensities: list[float | None] = [None if self.exploration == "thompson" else 1.0] * N
        if self.exploration == "eps-greedy":
            arms, propensities = self._eps_greedy(arms, bi[:N, :P])
        # Which requests the engine should record target argmax rows for (Jacobi's next draft).
        # Only where the next Jacobi draft may be used: requests playing Jacobi now (its iterate
        # goes on), and one request-step in shadow_every to keep scoring it where nothing else does.
        argmax_wanted = None
        jac = self._jacobi
        jacobi_played = False
        if jac >= 0:
            step, every = self.n_steps, self._shadow_interval()
            plays = [c == jac and k > 0 for c, k in played]
            # Whether Jacobi paid is read from this step's outcome (observe); a cost probe is no
            # sign that it does.
            jacobi_played = not probe and any(plays)
            argmax_wanted = [
                p or (s + step) % every == 0 for s, p in zip(slots.tolist(), plays, strict=True)
            ]
        if self.log_features:
            rows = np.arange(N)
            ks, g = bi[:N, buf.c_ks], buf.g[:N]
            exp_played = np.where(self._jpos[None, :] < ks[:, None], g, 0.0).sum(axis=1) + 1.0
            cp = bi[:N, buf.c_played]
            cp = np.where(cp >= 0, cp, bi[:N, buf.c_choice])
            hb, mb = self._hist_b[slots, cp].tolist(), bi[rows, P + cp].tolist()
            flag = 1.0 if played_base else 0.0
            feats = [
                [float(temp_l[i]), float(hb[i]), float(mb[i]), round(float(e), 4), flag]
                for i, e in enumerate(exp_played.tolist())
            ]
        else:
            feats = [[]] * N
        # The baseline's counterfactual for the safety rule is registered when the step is observed
        # (observe_step): only rows that played something else (none when the decision is the
        # baseline's, unless a probe changed it). The per-request arrays stay in self._buf.
        self._pending = {
            "step": self.n_steps,
            "index": dict(zip(req_ids, range(N), strict=True)),
            "n": N,
            "all_same": bool((same or played_base) and not probe),
            "batch_size": B,
            "sampled": sampled,
            "Vb": Vb,
            "calibrate": self.record_calibration,
            "jacobi_played": jacobi_played,
        }
        self.n_steps += 1
        info = {"played_baseline": played_base, "probe": probe, "lambda": round(lam, 4)}
        return Decision(arms, propensities, feats, argmax_wanted, info)

    def _adapter_gain(self, N: int, P: int, buf: kern.StepBuffers) -> float | None:
        """The controller's decision's predicted extra tokens from LoRA-adapted drafts: over the
        requests whose allocation plays one, its expected tokens minus those of the best other
        offered proposer at the same k (at most its offered length; the base ``draft`` counts as
        offered, since it drafts wherever no adapter applies). None when no adapted draft was offered
        this step. Read before the safety rule may replace the allocation."""
        bi = buf.ints
        avail = bi[:N, :P]
        if not (avail[:, self._adapted] > 0).any():
            return None
        ks, played = bi[:N, buf.c_ks], bi[:N, buf.c_choice]
        rows = np.flatnonzero((ks > 0) & (played >= 0) & self._adapted[np.maximum(played, 0)])
        if rows.size == 0:
            return 0.0
        n = rows.size
        av = avail[rows]
        d = self._pidx.get("draft", -1)
        if d >= 0:
            # The base draft drafts where no adapter applies: its acceptance cell prices it at the
            # same k for the requests whose last drafts came from an adapter.
            av[:, d] = np.maximum(av[:, d], ks[rows])
        a = np.where(self._jpos[None, None, :] < av[:, :, None], buf.alpha[rows], 0.0)
        e = np.cumsum(np.cumprod(a, axis=2), axis=2)  # expected accepted tokens at k = j + 1
        e_k = e[np.arange(n), :, ks[rows] - 1]  # [n, P]
        e_played = e_k[np.arange(n), played[rows]]
        e_alt = np.where(self._adapted[None, :], 0.0, e_k).max(axis=1)
        return float(np.maximum(e_played - e_alt, 0.0).sum())

    def drafter_adapters_wanted(self) -> bool:
        """Whether the drafter's next pass may apply LoRA adapters: while their predicted extra
        tokens pay for their extra time and the safety rule's slack covers it, plus probes
        (:class:`~adaptive_spec.core.drafter_cost.DrafterCost`); never on a rest step."""
        return self.drafter.wanted and not self._resting

    def _allocate(
        self,
        g: np.ndarray,
        batch_size: int,
        N: int,
        sampled: float = 0.0,
        v_max: int | None = None,
    ) -> tuple[np.ndarray, float, np.ndarray, int]:
        """Draft tokens per request maximising predicted goodput (step 3 of the module docstring;
        :func:`adaptive_spec.core.controller_kernels.allocate`).

        ``g``: float64 [N, K], the gain of each request's j-th draft token (``-inf`` where not offered),
        non-increasing along j; ``sampled``: the share of requests with temperature > 0 (which step-cost
        part prices the step); ``v_max``: the finite entries of ``g`` when known. Returns
        ``(ks, lambda, t_curve, v_max)``."""
        if v_max is None:
            v_max = int(np.isfinite(g).sum())
        t_curve = self.cost.curve(max(batch_size, N), v_max, sampled)
        ks, _, lam, _ = kern.allocate(np.ascontiguousarray(g, dtype=np.float64), v_max, t_curve)
        return ks, lam, t_curve, v_max

    def _probe(self, g: np.ndarray) -> np.ndarray:
        """A verification to keep measuring what speculation costs, at a realistic operating point:
        the draft tokens whose predicted acceptance is at least 0.25 (at least the best one, at most
        ``max(4, N // 4)`` of them, so a probe costs a fraction of a step)."""
        N, K = g.shape
        flat = np.where(np.isfinite(g), g, -1.0).reshape(-1)
        order = np.argsort(-flat, kind="stable")
        n = int((flat >= 0.25).sum())
        n = min(max(n, 1), max(4, N // 4), int((flat >= 0).sum()))
        return np.bincount(order[:n] // K, minlength=N).astype(np.int64)

    def _eps_greedy(
        self, arms: list[Arm], avail: np.ndarray
    ) -> tuple[list[Arm], list[float | None]]:
        out, props = [], []
        for i, arm in enumerate(arms):
            options = [NO_SPEC] + [
                Arm(p, c)
                for pi, p in enumerate(self.proposers)
                for c in range(1, int(avail[i, pi]) + 1)
            ]
            pick = arm
            if self.rng.random() < self.epsilon:
                pick = options[int(self.rng.integers(len(options)))]
            prop = (1.0 - self.epsilon) * (1.0 if pick == arm else 0.0) + self.epsilon / len(
                options
            )
            out.append(pick)
            props.append(prop)
        return out, props

    # -- learning -----------------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        """Learn from one step (see the module docstring)."""
        t = outcome.step_time_s
        pend, self._pending = self._pending, None
        sampled = pend["sampled"] if pend is not None else 0.0
        # A draft model's pass is priced apart from the table (adaptive_spec.core.drafter_cost); the part
        # of it that LoRA adapters added is time the baseline would not have paid.
        d = outcome.drafter_time_s
        extra = self.drafter.observe(d, outcome.drafter_adapters) if d > 0 else 0.0
        self.cost.update(
            outcome.batch_size,
            outcome.num_verified_tokens,
            t - d if 0 < d < t else t,
            outcome.num_prefill_tokens,
            sampled=sampled,
        )
        if pend is None:  # nothing was decided for this step (prefill only, or a rest step)
            if self._resting:
                self._resting = False
                self._commit_rest(outcome)
            self._finish_released(outcome)
            return
        rows_l, elens, flat, finished, done = _flatten(outcome, pend["index"])
        run_tokens = float(len(flat))
        # The safety rule compares the decided requests' tokens with the baseline's on them.
        self.guard.add_step(run_tokens, t)
        acc, tracker = self.acceptance, self.tracker
        # The step's time under the baseline: measured, without the adapters' extra drafter time,
        # + the table's difference.
        base_time = math.nan
        if math.isfinite(t) and t > 0:
            B = pend["batch_size"]
            dt = self.cost.at(B, pend["Vb"], sampled) - self.cost.at(
                B, outcome.num_verified_tokens, sampled
            )
            base_time = max(t - extra + dt, 1e-9)
        # One compiled call: the decision's baseline drafts registered; acceptance labels and
        # histories; every row's committed tokens to the safety tracker (a draft registered on an
        # earlier step is resolved by the tokens committed after it, whatever the request played
        # since), the baseline drafts they decide, and the steps whose baseline counterfactual is
        # complete counted by the safety rule.
        N, buf = pend["n"], self._buf
        tracker._reserve(N)
        m, tracker.n_pending = kern.observe_step(
            np.array(rows_l + elens + finished + flat, dtype=np.int64),
            len(rows_l),
            len(finished),
            N,
            buf.drafts,
            buf.ints,
            buf.learned,
            self._base_index,
            pend["all_same"],
            pend["step"],
            acc.counts4,
            acc.discount,
            self._hist_rate,
            self._hist_n,
            self._hist_b,
            self.ema_weight,
            HIST_EDGES[0],
            HIST_EDGES[1],
            tracker.ring,
            tracker.length,
            *tracker._pending_arrays(),
            tracker.n_pending,
            tracker.rec,
            tracker.rec_step,
            tracker.rec_bounds,
            self.guard.resolved,
            base_time,
            run_tokens,
            t,
        )
        if pend["jacobi_played"]:
            self._jacobi_outcome(outcome, pend["step"])
        if m:
            acc.counts_changed()
            if pend["calibrate"]:
                ri, pi, ones, zero = buf.learned[:, :m]
                self._record_calibration(buf.alpha[:N], ri, pi, ones, zero)
        for rid in done:
            self.release(rid)

    def _jacobi_outcome(self, outcome: StepOutcome, step: int) -> None:
        """Update Jacobi's moving acceptance rate from a step that played it; it pays (full-rate
        shadow samples, :meth:`_shadow_interval`) while the rate is at least ``_JACOBI_PAYS_RATE``."""
        drafted = accepted = 0
        for o in outcome.requests:
            if o.drafted > 0 and o.arm.proposer == "jacobi":
                drafted += o.drafted
                accepted += o.accepted
        if drafted:
            self._jacobi_rate += _JACOBI_RATE_WEIGHT * (accepted / drafted - self._jacobi_rate)
            if self._jacobi_rate >= _JACOBI_PAYS_RATE:
                self._jacobi_paid_at = step

    def _commit_rest(self, outcome: StepOutcome) -> None:
        """A rest step's committed tokens to the safety tracker: they resolve the baseline drafts
        registered before the rest, and keep each request's position in step."""
        tracker = self.tracker
        slots, lens, flat, finished, _ = _flatten(outcome, self._slot)
        if not slots:
            return
        tracker.commit_flat(
            np.array(slots, dtype=np.int64),
            np.array(lens, dtype=np.int64),
            np.array(flat, dtype=np.int64),
        )
        if tracker.n_pending:
            done = np.zeros(tracker.length.shape[0], dtype=np.bool_)
            done[finished] = True
            tracker.resolve(done, into=self.guard.resolved)

    def _finish_released(self, outcome: StepOutcome) -> None:
        for o in outcome.requests:
            if o.finished:
                self.release(o.req_id)

    def _record_calibration(
        self,
        alpha: np.ndarray,
        ri: np.ndarray,
        pi: np.ndarray,
        ones: np.ndarray,
        zero: np.ndarray,
    ) -> None:
        """Keep the predicted conditional acceptance of every judged position with its label
        (``alpha`` float64 [N, P, K] of the decision; the judged rows as returned by
        :func:`adaptive_spec.core.controller_kernels.learn`)."""
        judged = self._jpos[None, :] < (ones + zero)[:, None]
        r_i, j_i = np.nonzero(judged)
        self.calibration_records.append(
            (pi[r_i], j_i, alpha[ri[r_i], pi[r_i], j_i], (j_i < ones[r_i]).astype(np.int8))
        )

    # -- other verbs --------------------------------------------------------------------------------
    def _shadow_interval(self) -> int:
        """Request-steps per shadow sample of Jacobi: ``shadow_every`` while Jacobi paid in the last
        256 steps (the moving acceptance rate of its played draft tokens was at least 0.2), and
        during the first 256 steps when nothing is known about it (on a model without a prior,
        Jacobi may be what drafts where nothing else does); else 8 times that (a weak arm costs
        little: a shipped prior or a loaded state already scored it). Being played, or a lucky
        accepted token, is not enough: the allocation plays a shadow guess where it is a request's
        only draft, and on the embedded default about one Jacobi draft token in 20-50 is accepted,
        which would keep the full rate on for good."""
        paid = self._jacobi_paid_at
        if paid is None:
            recent = self.n_steps <= _JACOBI_RECENT and "jacobi" not in self.acceptance.loaded
        else:
            recent = self.n_steps - paid <= _JACOBI_RECENT
        return self.shadow_every if recent else 8 * self.shadow_every

    def jacobi_guess_wanted(self, req_ids: list[str]) -> list[bool]:
        """Jacobi's initial guess on the shadow schedule (one request-step in ``shadow_every``), so
        that Jacobi keeps being scored where nothing else verifies: a verified guess records the
        target's argmax, which is the next step's real iterate."""
        if self._jacobi < 0:
            return [False] * len(req_ids)
        t = self.n_steps
        every = self._shadow_interval()
        out = []
        for rid in req_ids:
            s = self._slot.get(rid)
            out.append(s is not None and (s + t) % every == 0)
        return out

    def drafter_preference(self, req_id: str, candidates: list[str]) -> str | None:
        """The draft-model proposer (``draft`` / ``lora:<name>``) with the highest upper confidence
        bound on expected accepted length at ``max_k`` for this request (its history bucket with
        each; a candidate never observed is tried first), among the LoRA adapters only on a probe of
        their drafter cost (:class:`~adaptive_spec.core.drafter_cost.DrafterCost`). ``None`` if no
        candidate is enabled here."""
        cands = [p for p in candidates if p in self._pidx]
        if self.drafter.probing:
            cands = [p for p in cands if self._adapted[self._pidx[p]]] or cands
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        untried = [p for p in cands if self.acceptance.tri[self._pidx[p]].sum() == 0]
        if untried:  # every candidate gets tried once
            return untried[0]
        s = self._slot.get(req_id)
        ucb = self.acceptance.optimistic(1.0)
        scores = []
        for p in cands:
            pi = self._pidx[p]
            h = 0
            if s is not None:
                h = int(
                    history_bucket(self._hist_rate[s, pi : pi + 1], self._hist_n[s, pi : pi + 1])[0]
                )
            c = self.acceptance.cell(np.array([pi]), np.array([0]), np.array([h]), np.array([0]))
            scores.append(float(np.cumprod(ucb[c[0]]).sum()))
        return cands[int(np.argmax(scores))]

    def estimated_acceptance(self) -> dict[str, float]:
        """Posterior-mean first-position acceptance per proposer for a greedy request with no history
        and its proposer's best match bucket (for metrics)."""
        out = {}
        for p, pi in self._pidx.items():
            c = self.acceptance.cell(
                np.array([pi]), np.array([0]), np.array([0]), np.array([N_MATCH - 1])
            )
            out[p] = float(self.acceptance.table()[c[0], 0])
        return out

    def calibration(self, bins: int = 10) -> dict[str, Any]:
        """Predicted against observed conditional acceptance of every judged draft position since
        ``record_calibration`` was set: per proposer and position (mean predicted, observed rate,
        count) and a reliability table over ``bins`` bins of the prediction, with the expected
        calibration error (the count-weighted mean |predicted - observed| over the bins)."""
        if not self.calibration_records:
            return {}
        p = np.concatenate([r[0] for r in self.calibration_records])
        j = np.concatenate([r[1] for r in self.calibration_records])
        a = np.concatenate([r[2] for r in self.calibration_records])
        y = np.concatenate([r[3] for r in self.calibration_records]).astype(float)
        out: dict[str, Any] = {}
        for pi, name in enumerate(self.proposers):
            m = p == pi
            if not m.any():
                continue
            by_pos = []
            for jj in range(self.max_k):
                mj = m & (j == jj)
                if mj.any():
                    by_pos.append(
                        {
                            "position": jj + 1,
                            "n": int(mj.sum()),
                            "predicted": round(float(a[mj].mean()), 4),
                            "observed": round(float(y[mj].mean()), 4),
                        }
                    )
            edges = np.linspace(0, 1, bins + 1)
            b = np.clip(np.searchsorted(edges, a[m], side="right") - 1, 0, bins - 1)
            rel = []
            ece = 0.0
            for k in range(bins):
                mk = b == k
                if mk.any():
                    pr, ob, n = float(a[m][mk].mean()), float(y[m][mk].mean()), int(mk.sum())
                    rel.append(
                        {
                            "bin": [round(edges[k], 2), round(edges[k + 1], 2)],
                            "n": n,
                            "predicted": round(pr, 4),
                            "observed": round(ob, 4),
                        }
                    )
                    ece += n * abs(pr - ob)
            out[name] = {
                "n": int(m.sum()),
                "by_position": by_pos,
                "reliability": rel,
                "ece": round(ece / max(int(m.sum()), 1), 4),
            }
        return out

    def stats(self) -> dict[str, Any]:
        """What the controller learned and how the safety rule stands (for ``AdaptiveSpec.stats``)."""
        return {
            "baseline": self.baseline_name,
            "guard": self.guard.as_dict(),
            "load_factor": round(self.cost.load, 4),
            "cost_table": self.cost.table.source,
            "rest_steps": self.rest_steps,
            **({"drafter": self.drafter.as_dict()} if self.drafter.n_plain else {}),
            "speculation_overhead_ms": {
                str(b): round(1e3 * self.cost.load * self.cost.table.speculation_overhead(b), 3)
                for b in (1, 4, 16)
            },
            "estimated_acceptance": {
                p: round(a, 4) for p, a in self.estimated_acceptance().items()
            },
        }

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "proposers": list(self.proposers),
            "max_k": self.max_k,
            "acceptance": self.acceptance.state_dict(),
            "cost": self.cost.state_dict(),
            "n_steps": self.n_steps,
        }

    def load_state_dict(self, state: dict, *, max_weight: float | None = 200.0) -> None:
        """Restore learned state: acceptance counts of the proposers both share (each cell capped at
        ``max_weight`` observations, so new traffic moves it) and the cost table (its load factor
        restarts at 1). Raises ValueError when the state does not fit (other ``max_k`` or cell layout,
        no proposer in common, or a malformed part); nothing is changed then."""
        if not isinstance(state, dict) or state.get("name") != self.name:
            raise ValueError(f"policy state is not an {self.name!r} controller state")
        if state.get("max_k") != self.max_k:
            raise ValueError(
                f"policy state has max_k={state.get('max_k')}; this controller has max_k={self.max_k}"
            )
        n_steps = state.get("n_steps", 0)
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"policy state has n_steps={n_steps!r}; expected an integer >= 0")
        saved = (state.get("acceptance") or {}).get("proposers")
        if isinstance(saved, list) and saved and not set(saved) & set(self.proposers):
            raise ValueError(
                f"policy state has proposers {saved}; this controller has {self.proposers} "
                "(none in common)"
            )
        acc = AcceptanceModel(self.proposers, self.max_k, discount=self.acceptance.discount)
        acc.load_state_dict(state.get("acceptance") or {}, max_weight=max_weight)
        cost = StepCostModel()
        cost.load_state_dict(state.get("cost") or {})
        # Everything parsed and validated: only now replace the learned state (never half-loaded).
        self.acceptance, self.cost = acc, cost
        self.n_steps = n_steps
