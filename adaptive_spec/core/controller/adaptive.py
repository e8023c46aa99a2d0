"""The adaptive controller's class: its decision, its learning and its reports
(:mod:`adaptive_spec.core.controller` describes the algorithm)."""

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
    match_bucket_table,
)
from adaptive_spec.core.arms import NO_SPEC, Arm, drafts_with_drafter
from adaptive_spec.core.baselines import baseline_rule
from adaptive_spec.core.controller_cost import ControllerCost
from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.drafter_cost import DrafterCost
from adaptive_spec.core.drafter_passes import passes_not_in_baseline
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepOutcome, StepView
from adaptive_spec.core.safety import BaselineTracker, ConservativeGuard

from .choices import adapter_gain, arm_table, decision_features, eps_greedy, probe_ks
from .records import BatchLists, OutcomeRows, PendingDecision
from .reports import CalibrationRecord, calibration_report
from .schedule import PROBE_NOTHING, PROBE_SPECULATE, JacobiShadow, ProbeSchedule
from .settings import check_parameters
from .slots import RequestSlots

# A no-speculation cost probe only while the decision's predicted goodput is below (1 + this) x the
# step's without draft tokens: beyond it, an error in that cell's price changes nothing.
_PROBE_ADVANTAGE = 0.15


class AdaptiveController(SpecPolicy):
    """The default controller (see :mod:`adaptive_spec.core.controller`).

    Parameters
    ----------
    proposers : list of str
        Proposers it may choose from (``none`` is always allowed).
    max_k : int >= 1
        Largest k (the engine's ``num_speculative_tokens``).
    baseline : str, StaticPolicy or BatchSizeTablePolicy, optional
        The safe baseline: ``none``, ``static:<proposer>:<k>``, ``table:<proposer>:<s>-<e>=<k>,...``
        or such a policy object. Default: :func:`~adaptive_spec.core.baselines.default_baseline` (an
        n-gram batch-size table when ``ngram`` is enabled, else ``none``).
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
        says it adds to a step (step 3 of :mod:`adaptive_spec.core.controller`); the safety rule and
        the cost model use the table's own times.
    drain_margin : int >= 0, "auto" or None
        While no request waits, the allocation counts only the requests within this many tokens of
        the largest remaining budget (step 3 of :mod:`adaptive_spec.core.controller`: the batch
        drains, and it ends with its longest request). "auto": ``2 * (max_k + 1)``, what two steps
        can commit (a request that close may still finish last; a smaller margin leaves requests
        that are about to become the last ones without drafts). None: per-step goodput always, as
        a server should use (its queue empties between arrivals and every request's latency
        counts).
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
        self.drain_margin = check_parameters(
            max_k=max_k,
            exploration=exploration,
            epsilon=epsilon,
            ucb_bonus=ucb_bonus,
            discount=discount,
            ema=ema,
            counts={
                "probe_every": probe_every,
                "shadow_every": shadow_every,
                "rest_after": rest_after,
                "wake_every": wake_every,
            },
            speculation_premium=speculation_premium,
            drain_margin=drain_margin,
            seed=seed,
        )
        kern.warm_up()  # the per-step kernels' machine code, loaded before the first step
        self.exploration = exploration
        self.epsilon = float(epsilon)
        self.ucb_bonus = float(ucb_bonus)
        self.ema_weight = float(ema)
        self.speculation_premium = float(speculation_premium)
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        self.acceptance = AcceptanceModel(self.proposers, max_k, discount=discount)
        self.cost = StepCostModel(cost_table)
        self.guard = ConservativeGuard(alpha)
        self.tracker = BaselineTracker(max_k)
        self.baseline = baseline_rule(baseline, self.proposers, max_k)
        self.controller_cost = ControllerCost(self.baseline, max_k)  # a static arm's own time
        P = len(self.proposers)
        self._pidx = {p: i for i, p in enumerate(self.proposers)}
        self._match_lut = match_bucket_table(self.proposers)
        self._layout = kern.CellLayout(self._match_lut, N_TEMP, N_HIST, N_MATCH)
        self._jpos = np.arange(max_k)
        self._no_table = np.zeros((0, max_k))
        self._arm_table = arm_table(self.proposers, max_k)
        base = self.baseline.proposer
        self._base_index = self._pidx.get(base, -1) if base else -1
        # LoRA-adapted drafts: their drafter pass costs more than a plain one (DrafterCost).
        self._adapted = np.array([p.startswith("lora:") for p in self.proposers], dtype=bool)
        self._has_adapted = bool(self._adapted.any())
        self.drafter = DrafterCost()
        self.slots = RequestSlots(P)
        self.schedule = ProbeSchedule(probe_every, rest_after, wake_every)
        self.jacobi = JacobiShadow(self._pidx.get("jacobi", -1), shadow_every)
        # The last decision's per-request arrays, written by decide_step and read by observe_step.
        self._buf = kern.StepBuffers(P, max_k)
        self._pending: PendingDecision | None = None  # the last decision, kept for observe
        self._lam = 0.0
        self.log_features = False
        # Calibration report (replay --calibration): the judged positions with their predictions.
        self.record_calibration = False
        self.calibration_records: list[CalibrationRecord] = []
        self.n_steps = 0

    # The schedules' parameters, read as the controller's.
    probe_every = property(lambda self: self.schedule.probe_every)
    rest_after = property(lambda self: self.schedule.rest_after)
    wake_every = property(lambda self: self.schedule.wake_every)
    shadow_every = property(lambda self: self.jacobi.shadow_every)

    @property
    def rest_steps(self) -> int:
        """Steps that rested (no proposer, no decision)."""
        return self.schedule.rest_steps

    # -- baseline ---------------------------------------------------------------------------------
    def baseline_k(self, batch_size: int) -> int:
        """The baseline's k at ``batch_size`` (0 outside every table row)."""
        return self.baseline.k_at(batch_size, self.max_k)

    @property
    def baseline_name(self) -> str:
        """The safe baseline's policy name (``none`` without speculation)."""
        return self.baseline.name

    # -- per-request slots --------------------------------------------------------------------------
    def release(self, req_id: str) -> None:
        pend = self._pending
        if pend is not None and req_id in pend.index:
            # Released between its decision and the observation (an abort): the baseline's draft
            # of it would never be resolved, so it is not registered.
            row = pend.index[req_id]
            self._buf.ints[row, self._buf.c_ks] = 0
            self._buf.ints[row, self._buf.c_kb] = 0
        self.slots.release(req_id, self.tracker)

    def num_tracked_requests(self) -> int:
        return len(self.slots)

    # -- decision -----------------------------------------------------------------------------------
    def rests(self, batch_size: int) -> bool:
        """Whether the coming step is a rest step (step 6 of :mod:`adaptive_spec.core.controller`):
        after ``rest_after`` quiet decisions, all but one step in ``wake_every``."""
        return self.schedule.rests(batch_size, self.cost)

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
        batch = BatchLists.gather(reqs, self.proposers, K)
        pos = batch.ints[:N]
        slots = self.slots.of(batch.req_ids, pos, self.tracker)
        # The share of requests that sample: their verification costs more (the sampled table).
        sampled = sum(batch.temp) / N
        B = view.batch_size
        curve_g, curve_s, mix = self.cost.part_curves(max(B, N), N * K, sampled)
        # The drafter's fixed part of every step (0 on other engines; DrafterCost.fixed_s) is outside
        # the table and its load factor: added to both curves so that the kernel's load * curve
        # includes it.
        c_draft = self.drafter.fixed_s
        if c_draft > 0.0:
            off, same_part = c_draft / self.cost.load, curve_s is curve_g
            curve_g = curve_g + off
            curve_s = curve_g if same_part else curve_s + off
        tracker = self.tracker
        bp = self._base_index
        kbase = self.baseline_k(B) if bp >= 0 else 0
        buf = self._buf
        buf.ensure(N)
        margin = -1 if self.drain_margin is None or view.queue_len > 0 else self.drain_margin
        objective = kern.Objective(
            curve_g, curve_s, mix, self.cost.load, self.speculation_premium, margin
        )
        res = kern.decide_step(
            kern.Batch(batch.parts, batch.ints, slots),
            self.slots.hist_b,
            tracker.length,
            self._layout,
            self._alpha_table(),
            self.acceptance.counts4,
            self._lam,
            objective,
            kbase,
            bp,
            buf.arrays,
        )
        v_max, V, lam, Vb, same, e_ctrl, var_ctrl, e_base, t_pred, tb_pred, n_stale = res
        self.controller_cost.time_static(view)  # a static arm's decision, timed on this view
        bi = buf.ints
        if n_stale:  # a step we did not observe: resynchronise those requests
            stale = tracker.length[slots] != pos
            for i in np.flatnonzero(stale).tolist():
                tracker.reset_slot(int(slots[i]), int(pos[i]))
        # What the controller's own decision gains from LoRA-adapted drafts (before the safety rule,
        # which may play the baseline's: the adapters' worth is the decision's, not the baseline's).
        gain = None
        if self._has_adapted:
            gain = adapter_gain(buf, N, self._adapted, self._pidx.get("draft", -1), self._jpos)
        # The safety rule: the baseline's decision when a deviation could break the constraint.
        played_base = False
        if not same:
            if math.isnan(tb_pred):
                tb_pred = self.cost.at(B, Vb, sampled) + c_draft
            lcb = max(float(N), e_ctrl - 2.0 * math.sqrt(var_ctrl))
            ucb_t = t_pred * math.exp(2.0 * self.cost.abs_log_residual)
            if not self.guard.allows(lcb, ucb_t, e_base / max(tb_pred, 1e-9), (e_base, tb_pred)):
                bi[:N, buf.c_ks] = bi[:N, buf.c_kb]
                bi[:N, buf.c_played] = bp
                played_base, V = True, Vb
        # Cost probes: the table is only corrected where steps are observed, so neither side of the
        # speculate / do-not-speculate boundary may go unmeasured for long.
        due = self.schedule.due_probe(V, v_max)
        probe = False
        if due == PROBE_SPECULATE:
            bi[:N, buf.c_ks] = probe_ks(buf.g[:N])
            bi[:N, buf.c_played] = bi[:N, buf.c_choice]
            probe = True
        elif due == PROBE_NOTHING and (
            # The no-speculation cell is measured on this engine at every batch size it runs at,
            # whatever the table says (the price of speculating at all is its difference), where
            # that price decides: while speculation's predicted advantage is small.
            self.cost.observed(B, 0) < self.cost.prior_weight
            and e_ctrl * (self.cost.at(B, 0, sampled) + c_draft)
            < (1.0 + _PROBE_ADVANTAGE) * N * t_pred
        ):
            bi[:N, buf.c_ks] = 0
            probe = True
        if probe:
            self.guard.probes += 1
        self.schedule.decided(V, probe)
        self._lam = lam
        if self._has_adapted:
            # Whether the drafter's next pass applies LoRA adapters (adaptive_spec.core.drafter_cost).
            fallback = e_base / max(tb_pred, 1e-9) if not math.isnan(tb_pred) else 0.0
            self.drafter.decide(
                gain,
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
            arms, propensities = eps_greedy(
                arms, bi[:N, :P], self.proposers, self.epsilon, self.rng
            )
        # Which requests the engine should record target argmax rows for (Jacobi's next draft).
        argmax_wanted, jacobi_played = self.jacobi.argmax_wanted(
            played, slots, self.n_steps, "jacobi" in self.acceptance.loaded, probe
        )
        feats: list[list[float]] = [[]] * N
        if self.log_features:
            feats = decision_features(
                buf, N, slots, self.slots.hist_b, batch.temp, self._jpos, played_base
            )
        # The baseline's counterfactual for the safety rule is registered when the step is observed
        # (observe_step): only rows that played something else (none when the decision is the
        # baseline's, unless a probe changed it). The per-request arrays stay in self._buf.
        self._pending = PendingDecision(
            step=self.n_steps,
            index=dict(zip(batch.req_ids, range(N), strict=True)),
            n=N,
            all_same=bool((same or played_base) and not probe),
            batch_size=B,
            sampled=sampled,
            Vb=Vb,
            calibrate=self.record_calibration,
            jacobi_played=jacobi_played,
        )
        self.n_steps += 1
        info = {"played_baseline": played_base, "probe": probe, "lambda": round(lam, 4)}
        return Decision(arms, propensities, feats, argmax_wanted, info)

    def drafter_adapters_wanted(self) -> bool:
        """Whether the drafter's next pass may apply LoRA adapters: while their predicted extra
        tokens pay for their extra time and the safety rule's slack covers it, plus probes
        (:class:`~adaptive_spec.core.drafter_cost.DrafterCost`); never on a rest step."""
        return self.drafter.wanted and not self.schedule.resting

    # -- learning -----------------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        """Learn from one step (see :mod:`adaptive_spec.core.controller`)."""
        t = outcome.step_time_s
        pend, self._pending = self._pending, None
        sampled = pend.sampled if pend is not None else 0.0
        # A draft model's pass is priced apart from the table (adaptive_spec.core.drafter_cost); the part
        # of it that LoRA adapters added is time the baseline would not have paid.
        d = outcome.drafter_time_s
        extra = (
            self.drafter.observe(d, outcome.drafter_adapters, outcome.drafter_passes)
            if d > 0
            else 0.0
        )
        self.cost.update(
            outcome.batch_size,
            outcome.num_verified_tokens,
            t - d if 0 < d < t else t,
            outcome.num_prefill_tokens,
            sampled=sampled,
        )
        if pend is None:  # nothing was decided for this step (prefill only, or a rest step)
            if self.schedule.resting:
                self.schedule.resting = False
                self._commit_rest(outcome)
            self._finish_released(outcome)
            return
        rows = OutcomeRows.of(outcome, pend.index)
        run_tokens = float(len(rows.tokens))
        # The safety rule compares the decided requests' tokens with the baseline's on them.
        self.guard.add_step(run_tokens, t)
        # The step's time under the baseline: measured, without the adapters' extra drafter time,
        # + the table's difference, with a static arm's controller time instead of this one's.
        base_time = math.nan
        if math.isfinite(t) and t > 0:
            B = pend.batch_size
            dt = self.cost.at(B, pend.Vb, sampled) - self.cost.at(
                B, outcome.num_verified_tokens, sampled
            )
            base = self.baseline.proposer
            kb = self.baseline_k(B) if drafts_with_drafter(str(base)) else 0
            passes = passes_not_in_baseline(outcome.drafter_time_s, outcome.drafter_passes, kb)
            charge = self.controller_cost.charge(outcome, B)
            base_time = max(t - extra - passes + dt - charge, 1e-9)
        # One compiled call: the decision's baseline drafts registered; acceptance labels and
        # histories; every row's committed tokens to the safety tracker (a draft registered on an
        # earlier step is resolved by the tokens committed after it, whatever the request played
        # since), the baseline drafts they decide, and the steps whose baseline counterfactual is
        # complete counted by the safety rule.
        N, buf, tracker, acc = pend.n, self._buf, self.tracker, self.acceptance
        tracker._reserve(N)
        obs = kern.Observation(
            np.array(rows.keys + rows.lens + rows.finished + rows.tokens, dtype=np.int64),
            len(rows.keys),
            len(rows.finished),
            base_time,
            run_tokens,
            t,
        )
        counts, s = acc.counts4, self.slots
        learning = kern.Learning(
            counts[0], counts[1], acc.discount, s.hist_rate, s.hist_n, s.hist_b,
            self.ema_weight, HIST_EDGES[0], HIST_EDGES[1],
        )  # fmt: skip
        m, tracker.n_pending = kern.observe_step(
            obs, N, pend.step, self._base_index, pend.all_same, buf.arrays, learning,
            tracker.tracked(self.guard.resolved), tracker.n_pending,
        )  # fmt: skip
        if pend.jacobi_played:
            self.jacobi.observe(outcome, pend.step)
        if m:
            acc.counts_changed()
            if pend.calibrate:
                ri, pi, ones, zero = buf.learned[:, :m]
                self.calibration_records.append(
                    CalibrationRecord.of(buf.alpha[:N], ri, pi, ones, zero, self._jpos)
                )
        for rid in rows.done:
            self.release(rid)

    def _commit_rest(self, outcome: StepOutcome) -> None:
        """A rest step's committed tokens to the safety tracker: they resolve the baseline drafts
        registered before the rest, and keep each request's position in step."""
        tracker = self.tracker
        rows = OutcomeRows.of(outcome, self.slots.index)
        if not rows.keys:
            return
        tracker.commit_flat(
            np.array(rows.keys, dtype=np.int64),
            np.array(rows.lens, dtype=np.int64),
            np.array(rows.tokens, dtype=np.int64),
        )
        if tracker.n_pending:
            done = np.zeros(tracker.length.shape[0], dtype=np.bool_)
            done[rows.finished] = True
            tracker.resolve(done, into=self.guard.resolved)

    def _finish_released(self, outcome: StepOutcome) -> None:
        for o in outcome.requests:
            if o.finished:
                self.release(o.req_id)

    # -- other verbs --------------------------------------------------------------------------------
    def _shadow_interval(self) -> int:
        """Request-steps per shadow sample of Jacobi now (:meth:`JacobiShadow.interval`)."""
        return self.jacobi.interval(self.n_steps, "jacobi" in self.acceptance.loaded)

    def jacobi_guess_wanted(self, req_ids: list[str]) -> list[bool]:
        """Jacobi's initial guess on the shadow schedule (one request-step in ``shadow_every``), so
        that Jacobi keeps being scored where nothing else verifies: a verified guess records the
        target's argmax, which is the next step's real iterate."""
        slots = [self.slots.index.get(rid) for rid in req_ids]
        return self.jacobi.guess_wanted(slots, self.n_steps, "jacobi" in self.acceptance.loaded)

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
        s = self.slots.index.get(req_id)
        ucb = self.acceptance.optimistic(1.0)
        scores = []
        for p in cands:
            pi = self._pidx[p]
            h = 0
            if s is not None:
                rate, n = self.slots.hist_rate[s, pi : pi + 1], self.slots.hist_n[s, pi : pi + 1]
                h = int(history_bucket(rate, n)[0])
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
        ``record_calibration`` was set (:func:`~adaptive_spec.core.controller.reports.calibration_report`)."""
        return calibration_report(self.calibration_records, self.proposers, self.max_k, bins)

    def stats(self) -> dict[str, Any]:
        """What the controller learned and how the safety rule stands (for ``AdaptiveSpec.stats``)."""
        return {
            "baseline": self.baseline_name,
            "guard": self.guard.as_dict(),
            "load_factor": round(self.cost.load, 4),
            "cost_table": self.cost.table.source,
            "rest_steps": self.rest_steps,
            "controller_time": self.controller_cost.as_dict(),
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

    def add_learning(self, delta: dict) -> bool:
        """Other replicas' acceptance counts and steps (the cost model stays this machine's own).
        Raises ValueError for another layout (nothing is changed then)."""
        self.acceptance.add_delta(delta.get("acceptance") or {})
        self.n_steps = max(0, self.n_steps + int(delta.get("n_steps", 0)))
        return True
