"""The safety rule in simulation: adversarial regimes never cost more than alpha against the baseline.

Each test replays one synthetic workload (known acceptance processes, :mod:`adaptive_spec.sim.synthetic`)
twice through the same step driver as the engine: once under the baseline policy alone (an n-gram
batch-size table), once under the adaptive controller holding that baseline. Time is charged by a true
cost profile; the controller only knows its (possibly wrong) table. The checks: the controller's
cumulative goodput stays >= (1 - alpha) x the baseline's at every quarter of the run after warm-up, and
it recovers from a regime change within 50 steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import CostProfile, TableCostProfile
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.synthetic import (
    AcceptanceProcess,
    Regime,
    RequestSpec,
    make_requests,
    stationary,
)

from adaptive_spec.core.baselines import BatchSizeTablePolicy
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.safety import BaselineTracker, ConservativeGuard

K = 8
ALPHA = 0.02
TABLE = [[1, 2, 8], [3, 8, 4], [9, 64, 2]]
COPY = Regime("copy", {"ngram": AcceptanceProcess(0.8, offer=0.4)})
DEAD = Regime("dead", {"ngram": AcceptanceProcess(0.0, offer=0.5)})
WEAK = Regime("weak", {"ngram": AcceptanceProcess(0.35, offer=0.5)})


def cpu_table(token_scale: float = 1.0, scale: float = 1.0) -> StepCostTable:
    B, V, T = [], [], []
    for b in (1, 2, 4, 8, 16):
        for v in (0, 1, 2, 4, 8, 16, 32, 64, 128):
            B.append(b)
            V.append(v)
            T.append(scale * (0.020 + 0.001 * b + 0.001 * (v > 0) + 0.00035 * token_scale * v))
    return StepCostTable.from_samples(B, V, T)


class LoadStep(CostProfile):
    """The true cost, multiplied by ``factor`` from step ``at`` on (a noisy neighbour arrives)."""

    def __init__(self, base: CostProfile, at: int, factor: float) -> None:
        self.base, self.at, self.factor, self.n = base, at, factor, 0

    def step_time(self, batch_size, verified_tokens, draft_passes=0, prefill_tokens=0):
        self.n += 1
        t = self.base.step_time(batch_size, verified_tokens, draft_passes, prefill_tokens)
        return t * (self.factor if self.n > self.at else 1.0)

    def minorants(self):
        return self.base.minorants()


def cumulative_time_at(res, fractions) -> list[float]:
    toks = np.cumsum(res.step_tokens)
    times = np.cumsum(res.step_time_s)
    return [float(times[np.searchsorted(toks, f * toks[-1])]) for f in fractions]


def run_pair(requests, profile_factory, table, batch=4):
    base = replay(
        requests,
        BatchSizeTablePolicy(["ngram"], K, "ngram", TABLE),
        profile_factory(),
        max_batch=batch,
    )
    ctrl = AdaptiveController(
        ["ngram"], K, baseline=f"table:ngram:{_table_text()}", alpha=ALPHA, cost_table=table
    )
    res = replay(requests, ctrl, profile_factory(), max_batch=batch)
    return base, res, ctrl


def _table_text() -> str:
    return ",".join(f"{s}-{e}={k}" for s, e, k in TABLE)


def assert_conservative(base, res, warmup_fraction=0.25):
    """Goodput >= (1 - alpha) x the baseline's at each quarter of the committed tokens."""
    fr = [warmup_fraction, 0.5, 0.75, 1.0]
    tb = cumulative_time_at(base, fr)
    tc = cumulative_time_at(res, fr)
    for f, a, b in zip(fr, tc, tb, strict=True):
        assert a <= b / (1 - ALPHA) * 1.005, (
            f"at {f:.0%} of the tokens: {a:.3f} s vs baseline {b:.3f} s"
        )


def spec_share_after(res, step: int) -> float:
    rows = [r["arm"] != "none" for s in res.step_arms[step:] for r in s["requests"]]
    return float(np.mean(rows)) if rows else 0.0


def test_acceptance_drops_to_zero_mid_run_and_the_controller_stops_within_50_steps():
    shift = 120
    specs = [RequestSpec(480, ((0, COPY), (shift, DEAD)), "shift") for _ in range(4)]
    reqs = make_requests(specs, K, seed=3)
    prof = TableCostProfile(cpu_table())
    base, res, _ = run_pair(reqs, lambda: prof, cpu_table())
    assert_conservative(base, res)
    assert res.goodput >= base.goodput  # the baseline keeps drafting into a dead regime
    # the step at which the requests reached the shift, then 50 steps to stop drafting
    toks_per_req = np.cumsum(res.step_tokens) / 4
    change = int(np.searchsorted(toks_per_req, shift))
    assert change < len(res.step_arms)
    assert spec_share_after(res, change + 50) <= 0.05, spec_share_after(res, change + 50)


def test_load_triples_mid_run():
    reqs = make_requests(stationary(WEAK, 8, 256), K, seed=4)
    true = TableCostProfile(cpu_table())
    base, res, ctrl = run_pair(reqs, lambda: LoadStep(true, 150, 3.0), cpu_table())
    assert_conservative(base, res)
    assert ctrl.cost.load == pytest.approx(3.0, rel=0.2)


@pytest.mark.parametrize("token_scale,scale", [(2.0, 1.0), (0.5, 2.0), (2.0, 2.0)])
def test_a_cost_table_2x_off_costs_at_most_alpha(token_scale, scale):
    reqs = make_requests(stationary(WEAK, 8, 256) + stationary(COPY, 4, 256), K, seed=5)
    true = TableCostProfile(cpu_table())
    base, res, _ = run_pair(reqs, lambda: true, cpu_table(token_scale, scale))
    assert_conservative(base, res)


def test_the_live_estimate_of_the_ratio_to_the_baseline_is_right():
    """The guard's counterfactual goodput ratio matches the two real runs (greedy, exact drafts)."""
    reqs = make_requests(stationary(COPY, 4, 384) + stationary(WEAK, 4, 384), K, seed=6)
    prof = TableCostProfile(cpu_table())
    base, res, ctrl = run_pair(reqs, lambda: prof, cpu_table())
    est = ctrl.guard.ratio()
    assert est is not None
    assert est == pytest.approx(res.goodput / base.goodput, rel=0.05)


def test_absorbing_state_speculation_resumes_when_it_pays():
    """A state that claims a draft token costs 100 ms: cost probes measure the truth and the
    controller speculates again (its goodput ends far above no speculation)."""
    bogus = StepCostTable.from_samples(
        [1, 4, 16] * 3,
        [0] * 3 + [1] * 3 + [64] * 3,
        [0.021, 0.024, 0.036, 0.121, 0.124, 0.136, 6.421, 6.424, 6.436],
    )
    reqs = make_requests(stationary(COPY, 8, 384), K, seed=7)
    prof = TableCostProfile(cpu_table())
    ctrl = AdaptiveController(["ngram"], K, baseline="none", cost_table=bogus)
    res = replay(reqs, ctrl, prof, max_batch=4)
    off = replay(reqs, BatchSizeTablePolicy(["ngram"], K, "ngram", [[1, 64, 0]]), prof, max_batch=4)
    assert res.goodput > 1.2 * off.goodput
    assert spec_share_after(res, len(res.step_arms) // 2) > 0.2


def test_guard_arithmetic():
    g = ConservativeGuard(0.1)
    assert g.slack(10.0) == 0.0
    g.add_step(10, 1.0)
    g.add_resolved(10, 1.0, 10, 1.0)
    assert g.baseline_goodput(99.0) == 10.0
    assert g.slack(99.0) == pytest.approx(1.0)  # 10 - 0.9 * 10 * 1
    assert g.allows(4, 0.5, 99.0)  # 1 + 4 - 4.5 >= 0
    assert not g.allows(1, 0.5, 99.0)
    assert g.ratio() == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"alpha=1\.5"):
        ConservativeGuard(1.5)


def test_tracker_resolves_counterfactual_drafts_as_tokens_arrive():
    t = BaselineTracker(4)
    t.reset_slot(0, 0)
    d = np.array([[5, 6, 7, 8]])
    t.add_drafts(0, np.array([0]), np.array([0]), d, np.array([4]))
    t.set_step_times(0, 0.02, 1.0, 0.02)
    t.commit(np.array([0]), [np.array([5])])
    assert t.resolve() == [] and t.pending() == 1  # one token known, all matching: undecided
    t.commit(np.array([0]), [np.array([6, 9])])
    done = t.resolve()
    assert t.pending() == 0 and done[0][1][0] == 3  # matched 2, then the correction token
    # a finished request resolves with what was known
    t.reset_slot(1, 0)
    t.add_drafts(1, np.array([1]), np.array([0]), d, np.array([4]))
    t.set_step_times(1, 0.02, 1.0, 0.02)
    t.commit(np.array([1]), [np.array([5, 6])])
    fin = np.zeros(t.ring.shape[0], dtype=bool)
    fin[1] = True
    assert t.resolve(fin)[0][1][0] == 2


def test_acceptance_is_calibrated_in_replay():
    """Predicted conditional acceptance of the judged positions matches the observed rates (the
    counts are calibrated by construction; the check is that nothing mislabels them)."""
    reqs = make_requests(stationary(COPY, 8, 256) + stationary(WEAK, 8, 256), K, seed=8)
    order = np.random.default_rng(0).permutation(len(reqs))  # a stationary mixture of the two
    reqs = [reqs[i] for i in order]
    ctrl = AdaptiveController(["ngram"], K, cost_table=cpu_table())
    ctrl.record_calibration = True
    replay(reqs, ctrl, TableCostProfile(cpu_table()), max_batch=4)
    cal = ctrl.calibration()["ngram"]
    assert cal["n"] > 1000 and cal["ece"] < 0.05, cal
    first = cal["by_position"][0]
    assert abs(first["predicted"] - first["observed"]) < 0.05


def test_every_committed_token_reaches_the_baseline_tracker():
    """A baseline draft registered on one step is resolved by the tokens committed after it, also
    when the request plays the baseline's own arm on the next steps: the tracker must see every
    row's tokens (it once saw only the rows that deviated, and then resolved such drafts against a
    resynchronised, empty history, which overstated the controller's ratio to the baseline)."""

    class Checked(AdaptiveController):
        mismatches = 0
        checked = 0

        def decide(self, view):
            for r in view.requests:  # requests the tracker follows already: in step with the engine
                s = self.slots.index.get(r.req_id)
                if s is not None:
                    self.checked += 1
                    self.mismatches += int(self.tracker.length[s] != r.num_output_tokens)
            return super().decide(view)

    reqs = make_requests(stationary(COPY, 4, 256) + stationary(WEAK, 4, 256), K, seed=7)
    ctrl = Checked(["ngram"], K, baseline=f"table:ngram:{_table_text()}", cost_table=cpu_table())
    res = replay(reqs, ctrl, TableCostProfile(cpu_table()), max_batch=4)
    assert res.goodput > 0 and ctrl.checked > 500
    assert ctrl.mismatches == 0, (ctrl.mismatches, ctrl.checked)
    # and the live estimate of the ratio is then close to the truth
    base = replay(
        reqs,
        BatchSizeTablePolicy(["ngram"], K, "ngram", TABLE),
        TableCostProfile(cpu_table()),
        max_batch=4,
    )
    assert ctrl.guard.ratio() == pytest.approx(res.goodput / base.goodput, rel=0.03)


def measured_table() -> StepCostTable:
    """:func:`cpu_table` as a calibration writes it: every cell backed by 10 measurements."""
    t = cpu_table()
    B, V, T = [], [], []
    for bi, b in enumerate(t.batch_sizes.tolist()):
        for vi, v in enumerate(t.draft_tokens.tolist()):
            if b <= 16 and v <= 128:
                B += [b] * 10
                V += [v] * 10
                T += [float(t.seconds[bi, vi])] * 10
    return StepCostTable.from_samples(B, V, T)


def test_rest_steps_when_nothing_pays_end_within_50_steps_of_a_regime_that_pays():
    """Drafts that are never accepted: after ``rest_after`` quiet decisions the controller rests
    (no decision on 3 of every 4 steps), and once the requests start copying it speculates again
    within 50 steps (the run ends 20 % above no speculation)."""
    shift = 200
    specs = [RequestSpec(480, ((0, DEAD), (shift, COPY)), "shift") for _ in range(4)]
    reqs = make_requests(specs, K, seed=8)
    prof = TableCostProfile(cpu_table())
    ctrl = AdaptiveController(["ngram"], K, baseline="none", cost_table=measured_table())
    decided: list[int] = []  # the step index of each decision
    orig = ctrl.decide

    def counting_decide(view):
        decided.append(len(res_steps))
        return orig(view)

    res_steps: list[bool] = []  # per decode step: whether it rested
    orig_rests = ctrl.rests

    def recording_rests(batch_size):
        r = orig_rests(batch_size)
        res_steps.append(r)
        return r

    ctrl.decide, ctrl.rests = counting_decide, recording_rests
    res = replay(reqs, ctrl, prof, max_batch=4)
    off = replay(reqs, BatchSizeTablePolicy(["ngram"], K, "ngram", [[1, 64, 0]]), prof, max_batch=4)
    # Rest steps make no decision; decisions happen on the others.
    assert ctrl.rest_steps == sum(res_steps) > 0
    assert len(decided) == len(res_steps) - ctrl.rest_steps
    toks_per_req = np.cumsum(res.step_tokens) / 4
    change = int(np.searchsorted(toks_per_req, shift))
    # Before the shift: resting on about 3 of 4 steps once quiet.
    quiet = res_steps[ctrl.rest_after + 8 : change]
    assert 0.6 <= np.mean(quiet) <= 0.8, np.mean(quiet)
    # After it: drafting again within 50 steps, and no rest once drafting.
    assert spec_share_after(res, change + 50) > 0.3
    assert not any(res_steps[change + 50 :])
    assert res.goodput > 1.2 * off.goodput


def test_no_rest_on_a_cost_table_that_is_only_a_guess():
    """A table cell backed by no measurement is probed and learned at full rate: no rest steps."""
    reqs = make_requests(stationary(DEAD, 4, 256), K, seed=9)
    prof = TableCostProfile(cpu_table())
    ctrl = AdaptiveController(["ngram"], K, baseline="none", cost_table=cpu_table())
    replay(reqs, ctrl, prof, max_batch=4)
    assert ctrl.rest_steps == 0
    rested = AdaptiveController(["ngram"], K, baseline="none", cost_table=measured_table())
    replay(reqs, rested, prof, max_batch=4)
    assert rested.rest_steps > 0


def test_rest_steps_keep_the_safety_rule_s_counterfactual_in_step():
    """While resting against a baseline that drafts, the committed tokens still resolve the
    baseline drafts registered before: the guard's estimate of the ratio to the baseline stays
    right, and no request falls out of step with the tracker."""
    reqs = make_requests(stationary(DEAD, 4, 384), K, seed=10)
    prof = TableCostProfile(cpu_table())
    base = replay(reqs, BatchSizeTablePolicy(["ngram"], K, "ngram", TABLE), prof, max_batch=4)
    rested = AdaptiveController(
        ["ngram"],
        K,
        baseline=f"table:ngram:{_table_text()}",
        alpha=ALPHA,
        cost_table=measured_table(),
    )
    resets = []
    orig_reset = rested.tracker.reset_slot

    def counting_reset(slot, position):
        resets.append(slot)
        orig_reset(slot, position)

    rested.tracker.reset_slot = counting_reset
    res2 = replay(reqs, rested, prof, max_batch=4)
    assert rested.rest_steps > 0
    # Each request's slot is reset when it starts and when it is released, never because the
    # tracker lost count of its committed tokens.
    assert len(resets) <= 2 * len(reqs), len(resets)
    est = rested.guard.ratio()
    assert est is not None
    assert est == pytest.approx(res2.goodput / base.goodput, rel=0.05)
    assert res2.goodput >= base.goodput  # the baseline drafts into a dead regime


# -- LoRA-adapted drafts: a drafter pass that costs more than the baseline's ----------------------
PLAIN_PASS, ADAPTED_PASS = 0.090, 0.135  # seconds (batch 4, float32, 2 CPU cores: 85-96 / 130-150)


def run_adapted_pair(lora_alpha: float, adapted_s: float = ADAPTED_PASS, seed: int = 8):
    """The baseline (n-gram table) and the controller with ``ngram`` and ``lora:chat`` on an engine
    whose draft-model pass costs PLAIN_PASS, or ``adapted_s`` when LoRA adapters apply."""
    regime = Regime(
        "chat",
        {
            "ngram": AcceptanceProcess(0.6, offer=0.35),
            "lora:chat": AcceptanceProcess(lora_alpha, offer=1.0),
        },
    )
    reqs = make_requests(stationary(regime, 8, 256), K, seed=seed)
    prof = TableCostProfile(cpu_table())
    passes = (PLAIN_PASS, adapted_s)
    base = replay(
        reqs,
        BatchSizeTablePolicy(["ngram"], K, "ngram", TABLE),
        prof,
        max_batch=4,
        drafter_pass_s=passes,
    )
    ctrl = AdaptiveController(
        ["ngram", "lora:chat"],
        K,
        baseline=f"table:ngram:{_table_text()}",
        alpha=ALPHA,
        cost_table=cpu_table(),
    )
    res = replay(reqs, ctrl, prof, max_batch=4, drafter_pass_s=passes)
    return base, res, ctrl


def adapted_share(res) -> float:
    rows = [r["arm"].startswith("lora:") for s in res.step_arms for r in s["requests"]]
    return float(np.mean(rows))


def test_adapters_that_do_not_pay_for_their_drafter_time_cost_at_most_alpha():
    """Weak adapted drafts (acceptance 0.3) on a pass 45 ms dearer than the plain one: the safety rule
    sees the extra time (the baseline is not charged it), so the run keeps within alpha of the
    baseline, the adapters end up on probe steps only, and the guard's live ratio is the real one."""
    base, res, ctrl = run_adapted_pair(0.3)
    assert_conservative(base, res)
    d = ctrl.drafter
    assert d.n_plain > 0 and d.n_adapted > 0
    assert d.extra_s == pytest.approx(ADAPTED_PASS - PLAIN_PASS, rel=1e-6)
    assert d.n_adapted <= 0.15 * res.steps, (d.n_adapted, res.steps)
    est = ctrl.guard.ratio()
    assert est is not None and est == pytest.approx(res.goodput / base.goodput, abs=0.03)
    # The table and its load factor learned the target's step, not the drafter's pass.
    assert ctrl.cost.load == pytest.approx(1.0, abs=0.15)


def test_adapters_that_pay_stay_on_and_beat_the_baseline():
    """Strong adapted drafts (acceptance 0.9) on a pass only 5 ms dearer: adapters stay on for most
    steps and the run beats the baseline."""
    base, res, ctrl = run_adapted_pair(0.9, adapted_s=PLAIN_PASS + 0.005)
    assert ctrl.drafter.n_adapted >= 0.8 * res.steps
    assert adapted_share(res) >= 0.5
    assert res.goodput >= 1.1 * base.goodput
    assert_conservative(base, res)


def test_drafter_fixed_cost_with_planned_passes():
    """Where the passes are planned, only steps without draft passes set the drafter's fixed cost:
    a probe's passes are not read as a cost of every later step."""
    from adaptive_spec.core.drafter_cost import DrafterCost

    d = DrafterCost(weight=0.5)
    d.observe(0.020, False)  # vLLM's full passes at every step (no plan): a plain pass is fixed
    assert d.fixed_s == pytest.approx(0.020)
    d = DrafterCost(weight=0.5)
    assert d.observe(0.024, False, passes=4) == 0.0  # a probe of 4 passes
    assert d.fixed_s == 0.0  # nothing seen yet of a step without passes
    for _ in range(3):
        d.observe(0.0001, False, passes=0)
    assert d.fixed_s == pytest.approx(0.0001)
    assert d.plain_s == pytest.approx(0.024)  # the passes' own average is kept apart
    d.observe(0.030, False, passes=4)
    assert d.fixed_s == pytest.approx(0.0001) and d.n_idle == 3
    # An adapted KV-cache pass on a step without draft passes counts as adapted, not as fixed.
    assert d.observe(0.040, True, passes=0) == pytest.approx(0.040 - d.plain_s)
    assert d.n_idle == 3 and d.n_adapted == 1
    assert d.as_dict()["fixed_ms"] == pytest.approx(0.1)


def test_drafter_cost_rule():
    from adaptive_spec.core.drafter_cost import DrafterCost

    d = DrafterCost(weight=0.5, probe_gap=2, max_probe_gap=8)
    assert d.observe(0.1, True) == 0.0  # no plain pass seen yet: nothing to compare with
    assert d.observe(0.09, False) == 0.0 and d.observe(0.11, False) == 0.0
    assert d.plain_s == pytest.approx(0.10)
    assert d.observe(0.16, True) == pytest.approx(0.06)
    assert d.extra_s == pytest.approx(0.13 - 0.10)
    for bad in (float("nan"), -1.0, 0.0, True):
        assert d.observe(bad, True) == 0.0
    assert d.n_adapted == 2
    # Pays: 2 extra tokens per step against 0.03 s x 40 tokens/s = 1.2, and the slack covers it.
    assert d.decide(2.0, 40.0, 5.0, 40.0) is True and d.wanted
    # Does not pay: off, then probes at gaps 2, 4, 8, 8.
    wanted = [d.decide(None if i % 3 else 0.0, 40.0, 5.0, 40.0) for i in range(30)]
    on = [i for i, w in enumerate(wanted) if w]
    assert np.diff(on).tolist()[:4] == [4, 8, 8, 8] or np.diff(on).tolist()[:3] == [4, 8, 8], on
    assert d.probes == len(on)
    # Pays per token but the safety rule's slack cannot cover the extra time: off (until a probe).
    d2 = DrafterCost(probe_gap=64, max_probe_gap=64)
    d2.observe(0.1, False)
    d2.observe(0.2, True)
    d2.decide(None, 40.0, 0.0, 40.0)  # the first decision after a plain pass probes
    assert d2.decide(10.0, 40.0, -20.0, 40.0) is False
    assert d2.decide(10.0, 40.0, 0.0, 40.0) is True
    with pytest.raises(ValueError, match="weight=0"):
        DrafterCost(weight=0)
    with pytest.raises(ValueError, match="probe_gap=0"):
        DrafterCost(probe_gap=0)
