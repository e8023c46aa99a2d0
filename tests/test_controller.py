"""The engine-agnostic controller: decisions, learning, bookkeeping, state, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from adaptive_spec.arms import NO_SPEC, Arm, arm_space
from adaptive_spec.controller import (
    AdaptiveController,
    RequestOutcome,
    RequestView,
    StepOutcome,
    StepView,
    acceptance_rows,
    matched_prefix,
)
from adaptive_spec.cost_model import StepCostModel
from adaptive_spec.policies import make_policy
from adaptive_spec.state import load_policy_state, save_policy_state


def test_arm_parse_and_normalise():
    assert Arm.parse("ngram:4") == Arm("ngram", 4)
    assert Arm.parse("none") is NO_SPEC
    assert Arm("jacobi", 0) == NO_SPEC
    assert str(Arm.parse("lora:code:2")) == "lora:code:2"
    for bad in ("ngram", "ngram:-1", "foo:3", "ngram:x"):
        with pytest.raises(ValueError):
            Arm.parse(bad)
    with pytest.raises(ValueError, match="max_k=-1"):
        arm_space(["ngram"], -1)
    assert len(arm_space(["none", "ngram", "jacobi"], 4)) == 9


def test_matched_prefix_and_rows():
    assert matched_prefix(np.array([1, 2, 3]), [1, 2, 9, 4]) == 2
    assert matched_prefix(np.array([1, 2]), [1, 2, 3]) == 2
    assert matched_prefix(np.array([], dtype=np.int64), [1]) == 0
    # draft longer than the emitted tokens, all matching: censored, no rejection row
    assert acceptance_rows(4, 2, 2) == (2, 0)
    # first position rejected
    assert acceptance_rows(4, 3, 0) == (0, 1)


def _simulate(
    ctrl, accept, steps, batch=4, cost=lambda b, v: 0.03 + 0.002 * b + 0.001 * v, seed=0, K=4
):
    """Requests whose proposer p drafts tokens accepted i.i.d. with probability accept[p]."""
    rng = np.random.default_rng(seed)
    chosen = []
    total_tokens = 0
    total_time = 0.0
    for t in range(steps):
        views = []
        truth = {}
        for i in range(batch):
            rid = f"r{i}"
            nxt = rng.integers(0, 1000, size=K + 1)
            truth[rid] = nxt
            drafts = {}
            for p, a in accept.items():
                acc = rng.random(K) < a
                d = np.where(acc, nxt[:K], (nxt[:K] + 1) % 1000)
                drafts[p] = d
            views.append(RequestView(rid, t, 1000, 0.0, drafts))
        dec = ctrl.decide(StepView(views, batch_size=batch))
        outs = []
        v_tot = 0
        for v, arm in zip(views, dec.arms, strict=True):
            chosen.append(arm)
            nxt = truth[v.req_id]
            if arm.k:
                d = v.drafts[arm.proposer][: arm.k]
                m = matched_prefix(d, nxt)
                emitted = list(nxt[: m + 1])
                outs.append(RequestOutcome(v.req_id, arm, arm.k, m, emitted))
                v_tot += arm.k
            else:
                outs.append(RequestOutcome(v.req_id, arm, 0, 0, list(nxt[:1])))
        dt = cost(batch, v_tot)
        total_time += dt
        total_tokens += sum(len(o.emitted_token_ids) for o in outs)
        ctrl.observe(StepOutcome(outs, dt, batch, v_tot))
    return chosen, total_tokens / total_time


def test_controller_learns_best_proposer():
    ctrl = AdaptiveController(["ngram", "jacobi"], 4, seed=1)
    chosen, _ = _simulate(ctrl, {"ngram": 0.9, "jacobi": 0.1}, 150)
    late = chosen[-200:]
    share_ngram = sum(a.proposer == "ngram" for a in late) / len(late)
    assert share_ngram > 0.8
    assert np.mean([a.k for a in late]) > 2.5  # high acceptance, cheap verification: long drafts


def test_controller_stops_speculating_when_it_costs():
    # Verification is expensive (each draft token costs as much as a whole extra request) and acceptance low.
    ctrl = AdaptiveController(["ngram"], 4, seed=2)
    chosen, g = _simulate(ctrl, {"ngram": 0.15}, 150, cost=lambda b, v: 0.01 + 0.01 * b + 0.02 * v)
    late = chosen[-200:]
    assert np.mean([a.k for a in late]) < 0.5
    base = AdaptiveController(["ngram"], 4)
    _, g0 = _simulate(
        make_policy("none", ["ngram"], 4),
        {"ngram": 0.15},
        150,
        cost=lambda b, v: 0.01 + 0.01 * b + 0.02 * v,
    )
    assert g >= 0.9 * g0
    assert base.num_tracked_requests() == 0


def test_release_and_no_leak():
    ctrl = AdaptiveController(["ngram"], 4)
    for t in range(2000):
        rid = f"q{t}"
        view = StepView([RequestView(rid, 0, 100, 0.0, {"ngram": np.array([1, 2, 3])})], 1)
        dec = ctrl.decide(view)
        ctrl.observe(
            StepOutcome(
                [RequestOutcome(rid, dec.arms[0], dec.arms[0].k, 0, [5], finished=True)],
                0.01,
                1,
                dec.arms[0].k,
            )
        )
    assert ctrl.num_tracked_requests() == 0


def test_budget_caps_k():
    ctrl = AdaptiveController(["ngram"], 8, exploration="greedy")
    views = [
        RequestView("a", 0, 3, 0.0, {"ngram": np.arange(8)}),
        RequestView("b", 0, 1, 0.0, {"ngram": np.arange(8)}),
    ]
    dec = ctrl.decide(StepView(views, 2))
    assert dec.arms[0].k <= 2 and dec.arms[1].k == 0


def test_cost_model_ignores_bad_times():
    m = StepCostModel()
    assert not m.update(4, 8, float("nan"))
    assert not m.update(4, 8, -1.0)
    assert not m.update(4, 8, float("inf"))
    assert m.n_ignored == 3 and m.n_updates == 0
    rng = np.random.default_rng(0)
    for _ in range(400):
        b, v = int(rng.integers(1, 16)), int(rng.integers(0, 64))
        m.update(b, v, 0.02 + 0.003 * b + 0.0005 * v)
    c0, cb, cv, _, _ = m.coefficients()
    assert math.isclose(c0, 0.02, rel_tol=0.05) and math.isclose(cb, 0.003, rel_tol=0.05)
    assert math.isclose(cv, 0.0005, rel_tol=0.05)
    with pytest.raises(ValueError, match="forgetting=0"):
        StepCostModel(forgetting=0)


def test_cost_model_learns_the_cost_per_speculating_request():
    """Each request that verifies drafts pays a fixed cost (vLLM's CPU build: ~2 ms per draft token at
    k = 1, ~1 ms at k = 8): the model separates it from the per-token slope, so one cheap-looking draft
    token is priced at its real cost."""
    m = StepCostModel()
    rng = np.random.default_rng(1)
    for _ in range(600):
        b = 4
        ks = [0 if rng.random() < 0.4 else int(rng.integers(1, 9)) for _ in range(b)]
        v, r = sum(ks), sum(k > 0 for k in ks)
        t = 0.02 + 0.0009 * v + 0.0011 * r + rng.normal(0, 0.0003)
        m.update(b, v, t, speculating_requests=r)
    *_, cv, _, cr = m.coefficients()
    assert math.isclose(cv, 0.0009, rel_tol=0.1) and math.isclose(cr, 0.0011, rel_tol=0.15)
    p0, p4, p32 = m.predict(4, np.array([0, 4, 32]), speculating_requests=np.array([0, 4, 4]))
    assert math.isclose(p4 - p0, 0.008, rel_tol=0.1) and math.isclose(p32 - p0, 0.0332, rel_tol=0.1)
    # Without a count, a step with drafts counts one speculating request.
    assert m.predict(4, 3) == pytest.approx(m.predict(4, 3, speculating_requests=1))


def test_allocation_skips_drafts_that_do_not_pay_the_per_request_cost():
    """With ~1 ms per speculating request and ~1 ms per draft token on a 20 ms step of 4 requests, a
    draft accepted with probability 0.14 (Jacobi's first position here) loses; one at 0.7 wins."""
    ctrl = AdaptiveController(["none", "ngram"], 4, seed=0, exploration="greedy")
    for _ in range(300):
        ctrl.cost.update(4, 0, 0.02, speculating_requests=0)
        ctrl.cost.update(4, 8, 0.02 + 0.008 + 0.002, speculating_requests=2)
        ctrl.cost.update(4, 16, 0.02 + 0.016 + 0.004, speculating_requests=4)
    low = np.array([[1.0, 1.14, 1.16, 1.17, 1.17]] * 4)
    assert (ctrl._allocate(low, 4) == 0).all()
    high = np.array([[1.0, 1.7, 2.19, 2.53, 2.77]] * 4)
    assert (ctrl._allocate(high, 4) > 0).all()


def test_cost_model_upgrades_a_state_saved_without_the_per_request_term():
    m = StepCostModel()
    for v in (0, 4, 8, 0, 2):
        m.update(4, v, 0.02 + 0.001 * v)
    old = m.state_dict()
    old["theta"] = old["theta"][:4]
    old["P"] = [row[:4] for row in old["P"][:4]]
    fresh = StepCostModel()
    fresh.load_state_dict(old)
    assert fresh.theta.shape == (5,) and fresh.P.shape == (5, 5) and fresh.theta[-1] == 0.0
    assert np.allclose(fresh.theta[:4], m.theta[:4])
    old["theta"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="wrong shapes"):
        fresh.load_state_dict(old)


def test_state_roundtrip_and_refusals(tmp_path):
    ctrl = AdaptiveController(["ngram", "jacobi"], 4, seed=5)
    _simulate(ctrl, {"ngram": 0.7, "jacobi": 0.2}, 30)
    path = tmp_path / "state.json"
    save_policy_state(ctrl, path)
    fresh = AdaptiveController(["ngram", "jacobi"], 4, seed=5)
    assert load_policy_state(fresh, path)
    assert json.dumps(fresh.state_dict()) == json.dumps(ctrl.state_dict())
    # incompatible: other proposers / max_k -> refused, unchanged
    other = AdaptiveController(["ngram"], 4)
    before = json.dumps(other.state_dict())
    assert not load_policy_state(other, path)
    assert json.dumps(other.state_dict()) == before
    # corrupt file -> refused
    path.write_text(path.read_text()[:50])
    assert not load_policy_state(fresh, tmp_path / "missing.json")
    assert not load_policy_state(fresh, path)


def test_bad_configuration():
    with pytest.raises(ValueError, match="exploration='nope'"):
        AdaptiveController(["ngram"], 4, exploration="nope")
    with pytest.raises(ValueError, match="max_k=-2"):
        AdaptiveController(["ngram"], -2)
    with pytest.raises(ValueError, match="proposer='x'"):
        AdaptiveController(["x"], 4)
    with pytest.raises(ValueError, match="policy='zzz'"):
        make_policy("zzz", ["ngram"], 4)
    with pytest.raises(ValueError, match=r"k=9 is out of range"):
        make_policy("static:ngram:9", ["ngram"], 4)
    p = make_policy("table:ngram:1-2=4,3-8=2", ["ngram"], 4)
    assert p.k_for(1) == 4 and p.k_for(5) == 2 and p.k_for(9) == 0


def test_drafter_preference_learns_the_best_adapter_per_request():
    """Only one draft-model proposer drafts per step (vLLM's drafter runs once); the controller picks
    it by Thompson sampling and ends up on the adapter whose drafts the target accepts."""
    family = ["draft", "lora:code", "lora:math"]
    ctrl = AdaptiveController(["none", *family], 4, seed=1)
    accept = {"draft": 0.3, "lora:code": 0.9, "lora:math": 0.05}
    rng = np.random.default_rng(0)
    current = "draft"
    picks = []
    for t in range(300):
        nxt = rng.integers(0, 1000, size=5)
        acc = rng.random(4) < accept[current]
        d = np.where(acc, nxt[:4], (nxt[:4] + 1) % 1000)
        view = RequestView("r0", t, 1000, 0.0, {current: d})
        arm = ctrl.decide(StepView([view], batch_size=1)).arms[0]
        if arm.k:
            m = matched_prefix(v := view.drafts[arm.proposer][: arm.k], nxt)
            out = RequestOutcome("r0", arm, len(v), m, list(nxt[: m + 1]))
        else:
            out = RequestOutcome("r0", arm, 0, 0, list(nxt[:1]))
        ctrl.observe(StepOutcome([out], 0.03, 1, arm.k))
        current = ctrl.drafter_preference("r0", family)
        assert current in family
        picks.append(current)
    assert set(picks[:100]) == set(family)  # every adapter is tried
    assert picks[-100:].count("lora:code") >= 90, picks[-100:]
    # Unknown candidates are ignored; none left gives None; the base class leaves the choice open.
    assert ctrl.drafter_preference("r0", ["lora:other", "draft"]) == "draft"
    assert ctrl.drafter_preference("r0", ["lora:other"]) is None
    assert (
        make_policy("static:ngram:2", ["none", "ngram"], 4).drafter_preference("r0", family) is None
    )
