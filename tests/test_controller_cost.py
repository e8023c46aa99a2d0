"""The controller's own time in the safety rule: the baseline's counterfactual step is charged a
static arm's controller time (:mod:`adaptive_spec.core.controller_cost`), measured with fake clocks
here so that nothing depends on this machine's speed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.synthetic import AcceptanceProcess, Regime, make_requests, stationary

import adaptive_spec.core.driver as driver_module
from adaptive_spec.core.arms import NO_SPEC
from adaptive_spec.core.baselines import baseline_rule
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.controller_cost import ControllerCost
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.driver import LiveRequest, StepDriver, VerifiedRequest
from adaptive_spec.core.protocol import (
    RequestOutcome,
    RequestView,
    StepOutcome,
    StepView,
    matched_prefix,
)
from adaptive_spec.proposers.ngram import NgramProposer

K = 4


class FakeClock:
    """``perf_counter`` that moves only when told to (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def _cost(b: int, v: int) -> float:
    return 0.03 + 0.002 * b + 0.001 * v


def _table() -> StepCostTable:
    vs = (0, 1, 2, 4, 8, 16)
    return StepCostTable.from_samples([4] * len(vs), list(vs), [_cost(4, v) for v in vs])


def _run(ctrl, steps, *, controller_s=0.0, policy_s=0.0, accept=0.7, flat=None, seed=0):
    """Four requests whose n-gram drafts are accepted i.i.d. with probability ``accept``; every
    outcome carries the given controller times (s), and every step lasts ``flat`` s if given.
    Returns the arms played."""
    rng = np.random.default_rng(seed)
    played = []
    pos = dict.fromkeys(("r0", "r1", "r2", "r3"), 0)
    for _ in range(steps):
        views, truth = [], {}
        for rid in pos:
            nxt = rng.integers(0, 1000, size=K + 1)
            truth[rid] = nxt
            d = np.where(rng.random(K) < accept, nxt[:K], (nxt[:K] + 1) % 1000)
            views.append(RequestView(rid, pos[rid], 100_000, 0.0, {"ngram": d}))
        dec = ctrl.decide(StepView(views, batch_size=4))
        outs, v_tot = [], 0
        for v, arm in zip(views, dec.arms, strict=True):
            played.append(arm)
            nxt = truth[v.req_id]
            m = matched_prefix(v.drafts["ngram"][: arm.k], nxt) if arm.k else 0
            outs.append(RequestOutcome(v.req_id, arm, arm.k, m, list(nxt[: m + 1])))
            v_tot += arm.k
            pos[v.req_id] += m + 1
        t = _cost(4, v_tot) if flat is None else flat
        ctrl.observe(
            StepOutcome(outs, t, 4, v_tot, controller_time_s=controller_s, policy_time_s=policy_s)
        )
    return played


def _controller(alpha: float, baseline: str = "static:ngram:2") -> AdaptiveController:
    ctrl = AdaptiveController(["ngram"], K, baseline=baseline, alpha=alpha, cost_table=_table())
    ctrl.controller_cost.clock = FakeClock()  # the static policy's decision: 0 s
    return ctrl


def test_a_slower_decision_makes_the_baseline_counterfactual_faster_by_the_difference():
    """alpha close to 1: the safety rule never binds, so every run plays the same decisions and only
    the baseline's counterfactual time moves, by the charge per resolved step."""
    runs = {}
    for name, ctrl_s, policy_s in (
        ("none", 0.0, 0.0),  # outcomes without controller time (replay)
        ("equal", 0.004, 0.0),  # as fast as the static arm: nothing is charged
        ("slower", 0.004, 0.003),  # its decision and observation cost 3 ms more than a static arm's
    ):
        ctrl = _controller(alpha=0.999)
        arms = _run(ctrl, 120, controller_s=ctrl_s, policy_s=policy_s, flat=0.04)
        runs[name] = (arms, ctrl.guard.resolved.copy(), ctrl)
    arms0, res0, _ = runs["none"]
    for name in ("equal", "slower"):
        assert runs[name][0] == arms0  # the same decisions
    assert np.array_equal(runs["equal"][1], res0)
    res1, ctrl1 = runs["slower"][1], runs["slower"][2]
    assert res1[[0, 2, 3]] == pytest.approx(res0[[0, 2, 3]])  # tokens, the run's time
    assert any(a.k for a in arms0)  # the decisions speculate
    # Every step lasted 40 ms: the resolved steps are the run's resolved time over 40 ms.
    n_resolved = res0[3] / 0.04
    assert n_resolved > 50
    assert res1[1] == pytest.approx(res0[1] - 0.003 * n_resolved)
    stats = ctrl1.stats()["controller_time"]
    assert stats["charged_ms"] == pytest.approx(3.0)
    assert stats["static_ms"] == pytest.approx(1.0) and stats["controller_ms"] == pytest.approx(4.0)
    assert runs["equal"][2].stats()["controller_time"]["charged_ms"] == 0.0
    assert runs["none"][2].stats()["controller_time"]["steps"] == 0


def test_the_controller_s_own_time_spends_the_safety_rule_s_allowance():
    """The controller's own time beyond a static arm's, charged to the baseline, is paid whichever
    decision is played, so it spends the slack: once it is gone, a deviation is played only where
    its bounds make it at least as good as the baseline's decision on the step."""

    def run(baseline, accept, policy_s):
        ctrl = _controller(alpha=0.02, baseline=baseline)
        arms = _run(ctrl, 200, controller_s=0.02, policy_s=policy_s, accept=accept)
        return np.mean([a.k for a in arms[-400:]]), ctrl.guard

    # Baseline none, drafts that nearly double goodput: 5 ms of own time per step (13 %) is seen
    # (the ratio to the baseline drops) but does not lock the controller into the baseline.
    k_free, free = run("none", 0.7, 0.0)
    k_costly, costly = run("none", 0.7, 0.005)
    assert k_free > 3.5 and k_costly > 3.5
    assert costly.ratio() < free.ratio() - 0.1
    # Baseline static:ngram:2, whose k = 4 gains a few per cent: 1 ms of own time per step (2 %)
    # spends the allowance, and the gain is within the bounds: the baseline's k = 2 is played.
    k_free, free = run("static:ngram:2", 0.7, 0.0)
    k_costly, costly = run("static:ngram:2", 0.7, 0.001)
    assert k_free > 3.5 and k_costly == pytest.approx(2.0)
    assert costly.refusals > 100 > free.refusals
    assert costly.ratio() < 1.0 < free.ratio()


def test_guard_plays_a_deviation_no_worse_than_a_baseline_that_loses_slack_too():
    from adaptive_spec.core.safety import ConservativeGuard

    g = ConservativeGuard(0.1)
    g.add_step(10, 1.0)
    g.add_resolved(10, 0.5, 10, 1.0)  # the baseline's time charged half of the run's: G_b = 20
    assert g.slack(99.0) == pytest.approx(-8.0)  # 10 - 0.9 * 20 * 1
    # the baseline's decision would change the slack by 5 - 0.9 * 20 * 0.5 = -4
    assert not g.allows(5, 0.5, 99.0)  # -8 + 5 - 9 < 0
    assert g.allows(5, 0.5, 99.0, (5.0, 0.5))  # -4 is no worse than the baseline's -4
    assert not g.allows(4, 0.5, 99.0, (5.0, 0.5))  # -5 is
    assert not g.allows(1, 0.5, 99.0, (10.0, 0.5))  # the baseline's decision gains slack: old rule


def test_charge_is_the_adaptive_only_time_less_a_static_decision():
    clock = FakeClock()
    cost = ControllerCost(baseline_rule("static:ngram:2", ["ngram", "suffix"], K), K, clock=clock)
    view = StepView([RequestView("a", 0, 100, 0.0, {"ngram": np.arange(4)})], batch_size=3)
    decide = cost.policy.decide

    def slow_decide(v):
        clock.advance(2e-5)
        return decide(v)

    cost.policy.decide = slow_decide
    cost.time_static(view)
    assert cost.static_decide_s(3) == pytest.approx(2e-5)
    assert cost.static_decide_s(64) == pytest.approx(2e-5)  # the nearest timed bucket
    out = StepOutcome([], 0.05, 3, 0, controller_time_s=1e-3, policy_time_s=3e-4)
    # the baseline's proposer drafts for a static arm too; the other one only for this controller
    out.proposer_time_s = {"ngram": 1e-4, "suffix": 2e-4}
    assert cost.charge(out, 3) == pytest.approx(3e-4 + 2e-4 - 2e-5)
    # nothing charged where the step time holds no controller time
    assert cost.charge(StepOutcome([], 0.05, 3, 0, policy_time_s=1.0), 3) == 0.0
    # never NaN, never more than the controller's time, which is never more than the step's
    for ctrl_s, pol_s in ((math.nan, 1e-3), (1e-3, math.nan), (1e-3, -5.0), (math.inf, 1.0)):
        out = StepOutcome([], 0.05, 3, 0, controller_time_s=ctrl_s, policy_time_s=pol_s)
        c = cost.charge(out, 3)
        assert math.isfinite(c) and -2.1e-5 <= c <= 0.05
    out = StepOutcome([], 0.01, 3, 0, controller_time_s=0.5, policy_time_s=0.5)
    assert cost.charge(out, 3) == pytest.approx(0.01)
    assert set(cost.as_dict()) == {
        "steps",
        "controller_ms",
        "static_ms",
        "charged_ms",
        "static_decide_us",
    }


def test_static_decisions_are_timed_first_then_one_in_every():
    clock = FakeClock()
    cost = ControllerCost(baseline_rule("none", ["ngram"], K), K, every=8, warm=2, clock=clock)
    assert cost.policy.decide(StepView([RequestView("a", 0, 9, 0.0)], 1)).arms == [NO_SPEC]
    view = StepView([RequestView("a", 0, 9, 0.0)], batch_size=5)
    for _ in range(20):
        cost.time_static(view)
    assert cost.timed[2] == 2 + 2  # decisions 0, 1, then 8 and 16
    assert cost.as_dict()["static_decide_us"] == {"4": 0.0}
    with pytest.raises(ValueError, match="every=0"):
        ControllerCost(baseline_rule("none", ["ngram"], K), K, every=0)
    with pytest.raises(ValueError, match="weight=0"):
        ControllerCost(baseline_rule("none", ["ngram"], K), K, weight=0)


def test_the_step_driver_measures_the_policy_and_each_proposer(monkeypatch):
    """The driver's clock (faked): the decision, the previous observation and each proposer's
    drafting reach the outcome; a decision 5 ms slower than a static arm's is charged 5 ms."""
    clock = FakeClock()
    monkeypatch.setattr(driver_module, "time", SimpleNamespace(perf_counter=clock))
    ctrl = AdaptiveController(["ngram"], K, baseline="static:ngram:2")
    ctrl.controller_cost.clock = clock
    static_decide = ctrl.controller_cost.policy.decide
    own_decide, own_observe = ctrl.decide, ctrl.observe
    seen: list[StepOutcome] = []

    def static_1ms(view):
        clock.advance(0.001)
        return static_decide(view)

    def decide_6ms(view):
        clock.advance(0.005)  # 5 ms of its own, plus the static arm's decision timed inside
        return own_decide(view)

    def observe_2ms(outcome):
        seen.append(outcome)
        clock.advance(0.002)
        own_observe(outcome)

    ctrl.controller_cost.policy.decide = static_1ms
    monkeypatch.setattr(ctrl, "decide", decide_6ms)
    monkeypatch.setattr(ctrl, "observe", observe_2ms)

    class Slow(NgramProposer):
        def propose(self, reqs, ks):
            clock.advance(0.0005)
            return super().propose(reqs, ks)

    driver = StepDriver(ctrl, {"ngram": Slow(max_k=K)}, max_k=K, vocab_size=100)
    driver.add_request("a", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7])
    for n in range(3):
        driver.decide([LiveRequest("a", n, 16 - n, 0.0)], batch_size=1)
        driver.observe(
            [VerifiedRequest("a", 0, 0, [8])],
            step_time_s=0.05,
            batch_size=1,
            num_verified_tokens=0,
            controller_time_s=0.01,
        )
    first, later = seen[0], seen[-1]
    assert first.proposer_time_s == {"ngram": pytest.approx(0.0005)}
    assert first.policy_time_s == pytest.approx(0.006)  # this decision (no observation before)
    assert first.controller_time_s == pytest.approx(0.01)
    # later steps: this decision, the previous observation of the policy and of the driver
    assert later.policy_time_s == pytest.approx(0.006 + 0.002)
    assert later.controller_time_s == pytest.approx(0.01 + 0.002)
    # the static arm's decision was timed on the first decisions: 1 ms at batch 1
    assert ctrl.controller_cost.static_decide_s(1) == pytest.approx(0.001)
    assert ctrl.controller_cost.charge(later, 1) == pytest.approx(0.008 - 0.001)


def test_replay_charges_no_controller_time():
    """Replay's simulated clock holds no controller time: its outcomes carry none and nothing is
    charged (the same decisions as before, whatever this machine's speed)."""
    regime = Regime("copy", {"ngram": AcceptanceProcess(0.8, offer=0.5)})
    reqs = make_requests(stationary(regime, 4, 64), K, seed=1)
    ctrl = AdaptiveController(["ngram"], K, baseline="static:ngram:2")
    seen: list[StepOutcome] = []
    observe = ctrl.observe

    def spy(outcome):
        seen.append(outcome)
        observe(outcome)

    ctrl.observe = spy
    from adaptive_spec.sim.cost_profiles import PRESETS

    res = replay(reqs, ctrl, PRESETS["cpu-smollm2"], max_batch=4)
    assert res.tokens > 0 and seen
    assert all(o.controller_time_s == 0.0 for o in seen)
    assert any(o.policy_time_s > 0.0 for o in seen)  # measured, not charged
    assert ctrl.controller_cost.steps == 0
