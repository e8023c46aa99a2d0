"""The engine-agnostic controller: decisions, learning, bookkeeping, state, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_spec.core import controller_kernels as kern
from adaptive_spec.core.arms import NO_SPEC, Arm, arm_space
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.cost_table import StepCostTable
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.protocol import (
    Decision,
    RequestOutcome,
    RequestView,
    SpecPolicy,
    StepOutcome,
    StepView,
    acceptance_rows,
    matched_prefix,
)
from adaptive_spec.core.state import load_policy_state, save_policy_state


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
    pos = dict.fromkeys((f"r{i}" for i in range(batch)), 0)
    for _ in range(steps):
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
            views.append(RequestView(rid, pos[rid], 100_000, 0.0, drafts))
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
        for o in outs:
            pos[o.req_id] += len(o.emitted_token_ids)
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
    """Each draft token costs 40 % of a step and acceptance is 0.15: with the measured table the
    controller stops speculating and is not slower than no speculation."""

    def cost(b, v):
        return 0.01 + 0.01 * b + 0.02 * v

    table = StepCostTable.from_samples(
        [4] * 5, [0, 1, 4, 8, 16], [cost(4, v) for v in (0, 1, 4, 8, 16)]
    )
    ctrl = AdaptiveController(["ngram"], 4, seed=2, baseline="none", cost_table=table)
    chosen, g = _simulate(ctrl, {"ngram": 0.15}, 150, cost=cost)
    late = chosen[-200:]
    assert np.mean([a.k for a in late]) < 0.2
    _, g0 = _simulate(make_policy("none", ["ngram"], 4), {"ngram": 0.15}, 150, cost=cost)
    assert g >= 0.97 * g0


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
    assert ctrl.tracker.pending() == 0 and ctrl.tracker.open_steps() <= 1


def test_budget_caps_k():
    ctrl = AdaptiveController(["ngram"], 8, exploration="greedy")
    views = [
        RequestView("a", 0, 3, 0.0, {"ngram": np.arange(8)}),
        RequestView("b", 0, 1, 0.0, {"ngram": np.arange(8)}),
    ]
    dec = ctrl.decide(StepView(views, 2))
    assert dec.arms[0].k <= 2 and dec.arms[1].k == 0


def _allocate(
    ctrl: AdaptiveController, g: np.ndarray, batch_size: int, N: int, sampled: float = 0.0
) -> tuple[np.ndarray, float, np.ndarray, int]:
    """The controller's allocation of draft tokens over its cost model's curve
    (:func:`adaptive_spec.core.controller_kernels.allocate`): ``(ks, lambda, t_curve, v_max)``."""
    v_max = int(np.isfinite(g).sum())
    t_curve = ctrl.cost.curve(max(batch_size, N), v_max, sampled)
    ks, _, lam, _ = kern.allocate(np.ascontiguousarray(g, dtype=np.float64), v_max, t_curve)
    return ks, lam, t_curve, v_max


def _goodput(gains: np.ndarray, t: np.ndarray, V: int) -> float:
    flat = np.sort(gains[np.isfinite(gains)])[::-1]
    return (gains.shape[0] + flat[:V].sum()) / t[V]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 12),
    k=st.integers(1, 8),
    seed=st.integers(0, 100_000),
    fixed=st.floats(0.0, 0.01),
    per_token=st.floats(0.0, 0.004),
)
def test_allocation_schedules_no_token_worth_less_than_its_time(n, k, seed, fixed, per_token):
    """With a monotone table: the allocation is the best prefix of the sorted gains, and its last
    token's expected gain is at least its marginal time at the throughput without it."""
    rng = np.random.default_rng(seed)
    alpha = rng.uniform(0.0, 1.0, size=(n, k))
    gains = np.cumprod(alpha, axis=1)
    avail = rng.integers(0, k + 1, size=n)
    gains = np.where(np.arange(k)[None, :] < avail[:, None], gains, -np.inf)
    vs = np.arange(0, n * k + 1)
    noise = np.maximum.accumulate(rng.uniform(0, 0.002, size=vs.size))
    t = 0.02 + fixed * (vs > 0) + per_token * vs + noise
    table = StepCostTable.from_samples([n] * vs.size, vs, t, token_grid=vs, batch_grid=[1, n + 1])
    ctrl = AdaptiveController(["ngram"], k, cost_table=table)
    ks, _, t_curve, v_max = _allocate(ctrl, gains, n, n)
    V = int(ks.sum())
    assert (ks <= np.maximum(avail, 0)).all()
    best = max(_goodput(gains, t_curve, v) for v in range(v_max + 1))
    assert _goodput(gains, t_curve, V) == pytest.approx(best, rel=1e-9)
    if V > 0:
        flat = np.sort(gains[np.isfinite(gains)])[::-1]
        throughput = (n + flat[: V - 1].sum()) / t_curve[V - 1]
        assert flat[V - 1] >= throughput * (t_curve[V] - t_curve[V - 1]) - 1e-9
    # the chosen tokens are each request's first ones (a prefix per request)
    for i in range(n):
        assert ks[i] <= max(avail[i], 0)


def test_allocation_skips_drafts_that_do_not_pay_the_fixed_cost():
    """1 ms to speculate at all plus 0.35 ms per token on a 24 ms step of 4 requests: a draft accepted
    with probability 0.05 loses (break-even is about 0.1 here); one at 0.7 wins."""
    vs = np.array([0, 1, 2, 4, 8, 16, 32])
    table = StepCostTable.from_samples([4] * vs.size, vs, 0.024 + 0.001 * (vs > 0) + 0.00035 * vs)
    ctrl = AdaptiveController(["ngram"], 4, cost_table=table)
    low = np.cumprod(np.full((4, 4), 0.05), axis=1)
    assert (_allocate(ctrl, low, 4, 4)[0] == 0).all()
    high = np.cumprod(np.full((4, 4), 0.7), axis=1)
    assert (_allocate(ctrl, high, 4, 4)[0] > 0).all()


def test_state_roundtrip_and_refusals(tmp_path):
    ctrl = AdaptiveController(["ngram", "jacobi"], 4, seed=5)
    _simulate(ctrl, {"ngram": 0.7, "jacobi": 0.2}, 30)
    path = tmp_path / "state.json"
    save_policy_state(ctrl, path)
    fresh = AdaptiveController(["ngram", "jacobi"], 4, seed=5)
    assert load_policy_state(fresh, path)
    a, b = fresh.state_dict(), ctrl.state_dict()
    assert json.dumps(a["acceptance"]) == json.dumps(b["acceptance"])
    assert a["cost"]["table"] == b["cost"]["table"] and a["n_steps"] == b["n_steps"]
    assert fresh.cost.load == 1.0  # the load factor is measured again after a load
    # another proposer set loads the proposers both share (the others keep their prior)
    other = AdaptiveController(["ngram"], 4)
    assert load_policy_state(other, path)
    assert other.acceptance.tri[0].sum() > 0
    # incompatible: another max_k -> refused, unchanged
    other8 = AdaptiveController(["ngram"], 8)
    before = json.dumps(other8.state_dict())
    assert not load_policy_state(other8, path)
    assert json.dumps(other8.state_dict()) == before
    # corrupt file -> refused
    path.write_text(path.read_text()[:50])
    assert not load_policy_state(fresh, tmp_path / "missing.json")
    assert not load_policy_state(fresh, path)


def test_bad_configuration():
    with pytest.raises(ValueError, match="exploration='nope'"):
        AdaptiveController(["ngram"], 4, exploration="nope")
    with pytest.raises(ValueError, match=r"baseline=.static:jacobi:2. is invalid"):
        AdaptiveController(["ngram"], 4, baseline="static:jacobi:2")
    with pytest.raises(ValueError, match=r"alpha=1\.0"):
        AdaptiveController(["ngram"], 4, alpha=1.0)
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
    it by an upper confidence bound and ends up on the adapter whose drafts the target accepts."""
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


def test_sampled_requests_are_priced_with_the_sampled_part():
    """The same drafts on a 24 ms step of 4 requests: worth verifying when greedy (0.35 ms per draft
    token), not when every request samples and a draft token costs 6 ms more. ``decide`` prices the
    step by its share of sampled requests."""
    vs = np.array([0, 1, 2, 4, 8, 16, 32])
    base = 0.024 + 0.001 * (vs > 0) + 0.00035 * vs
    greedy = StepCostTable.from_samples([4] * vs.size, vs, base)
    part = StepCostTable.from_samples([4] * vs.size, vs, base + 0.006 * vs)
    table = StepCostTable(greedy.batch_sizes, greedy.draft_tokens, greedy.seconds, sampled=part)
    g = np.cumprod(np.full((4, 4), 0.4), axis=1)
    ctrl = AdaptiveController(["ngram"], 4, cost_table=table, exploration="greedy", baseline="none")
    assert _allocate(ctrl, g, 4, 4, 0.0)[0].sum() > 0
    assert _allocate(ctrl, g, 4, 4, 1.0)[0].sum() == 0
    # decide prices the step by its share of sampled requests (here 2 of 4)
    views = [RequestView(f"r{i}", 5, 100, float(i % 2), {"ngram": np.arange(4)}) for i in range(4)]
    ctrl.decide(StepView(views, 4))
    assert ctrl._pending.sampled == 0.5


def _shadowed_share(ctrl: AdaptiveController, steps: int = 64, batch: int = 4) -> float:
    """Share of request-steps whose target argmax rows the controller asks for, with Jacobi never
    worth playing (its drafts are wrong and the cost table prices every draft token high)."""
    wanted = 0
    for t in range(steps):
        views = [
            RequestView(f"r{i}", t, 1000, 0.0, {"jacobi": np.array([7, 7, 7])})
            for i in range(batch)
        ]
        dec = ctrl.decide(StepView(views, batch))
        # Shadow samples only (a cost probe may verify Jacobi's draft and then needs its rows).
        wanted += sum(w and a.k == 0 for w, a in zip(dec.argmax_wanted, dec.arms, strict=True))
        ctrl.observe(
            StepOutcome(
                [RequestOutcome(f"r{i}", dec.arms[i], 0, 0, [1], False) for i in range(batch)],
                0.02,
                batch,
                0,
            )
        )
    return wanted / (steps * batch)


def test_jacobi_shadow_rate_starts_low_when_a_prior_scored_it():
    """Without anything known about Jacobi it is shadowed at the full rate (one request-step in
    ``shadow_every``) for the first 256 steps; once a loaded prior or state scored it, at one in
    ``8 * shadow_every`` from the start (the argmax rows cost about 0.5 ms each)."""
    vs = np.array([0, 1, 8])
    table = StepCostTable.from_samples([4, 4, 4], vs, 0.02 + 0.01 * vs)
    fresh = AdaptiveController(["jacobi"], 4, cost_table=table, shadow_every=4, baseline="none")
    assert _shadowed_share(fresh) == pytest.approx(1 / 4)
    informed = AdaptiveController(["jacobi"], 4, cost_table=table, shadow_every=4, baseline="none")
    informed.acceptance.load_state_dict(fresh.acceptance.state_dict())
    assert informed.acceptance.loaded == {"jacobi"}
    assert _shadowed_share(informed) == pytest.approx(1 / 32)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 10),
    p=st.integers(1, 3),
    k=st.integers(1, 8),
    seed=st.integers(0, 100_000),
    sampled=st.sampled_from([0.0, 0.3, 1.0]),
    kbase=st.integers(0, 8),
    premium=st.sampled_from([0.0, 0.5, 1.0]),
    from_counts=st.booleans(),
    margin=st.sampled_from([-1, 0, 3]),
)
def test_fused_decision_kernel_equals_its_parts(
    n, p, k, seed, sampled, kbase, premium, from_counts, margin
):
    """``decide_step`` (one call per decision) gives exactly what the posterior means (when it
    is given counts instead of a table), scoring, the cost curve, the allocation (over the curve
    with speculation priced at ``1 + premium`` times its cost, over the draining batch's gains when
    ``margin`` >= 0) and the safety rule's terms give one after another; the predicted times are the
    curve's."""
    from adaptive_spec.core.acceptance import N_HIST, N_MATCH, N_TEMP
    from adaptive_spec.core.cost_table import prior_table

    rng = np.random.default_rng(seed)
    base = prior_table()
    table = StepCostTable(
        base.batch_sizes, base.draft_tokens, base.seconds, sampled=base.scaled(1.3)
    )
    ctrl = AdaptiveController(["ngram", "jacobi", "suffix"][:p], k, cost_table=table)
    dlen = rng.integers(0, k + 3, size=n * p).astype(np.int64)
    parts = rng.integers(0, 50, size=int(dlen.sum())).astype(np.int64)
    mlen = rng.integers(0, 70, size=n * p).astype(np.int64)
    cap = rng.integers(0, 12, size=n).astype(np.int64)
    temp = rng.integers(0, 2, size=n).astype(np.int64)
    slots = rng.permutation(max(n, 16))[:n].astype(np.int64)
    hist_b = rng.integers(0, N_HIST, size=(max(n, 16), p)).astype(np.int64)
    n_cells = p * N_TEMP * N_HIST * N_MATCH
    tri = rng.uniform(0.0, 20.0, size=(n_cells, k))
    acc = tri * rng.uniform(0.0, 1.0, size=(n_cells, k))
    prior_a, prior_b = rng.uniform(0.1, 3.0, size=(2, n_cells, k))
    if from_counts:
        alpha_table = kern.posterior_mean(acc, tri, prior_a, prior_b)
        given = np.zeros((0, k))
    else:
        alpha_table = rng.uniform(0.0, 1.0, size=(n_cells, k))
        given = alpha_table
    lam = float(rng.uniform(0.0, 0.5))
    pos = rng.integers(0, 5, size=n).astype(np.int64)
    length = np.zeros(max(n, 16), dtype=np.int64)
    length[slots] = np.where(rng.random(n) < 0.8, pos, pos + 1)
    bp = int(rng.integers(-1, p))
    B = n + int(rng.integers(0, 3))
    cg, cs, mix = ctrl.cost.part_curves(B, n * k, sampled)
    ints = np.concatenate([pos, cap, temp, dlen, mlen])
    buf = kern.StepBuffers(p, k)
    buf.ensure(n)
    buf.ints[:] = -7  # stale contents of an earlier step must not leak into this one
    buf.g[:] = 3.0
    layout = kern.CellLayout(ctrl._match_lut, N_TEMP, N_HIST, N_MATCH)
    got = kern.decide_step(
        kern.Batch(parts, ints, slots), hist_b, length, layout, given,
        np.stack([acc, tri, prior_a, prior_b]), lam,
        kern.Objective(cg, cs, mix, ctrl.cost.load, premium, margin), kbase, bp, buf.arrays,
    )  # fmt: skip
    offers = kern.Offers(parts, dlen, mlen, cap, temp, hist_b[slots])
    scored, v_max = kern.score(offers, layout, alpha_table, lam)
    drafts, avail, match, cells, alpha, gains, choice, g = scored
    t_curve = ctrl.cost.curve(B, v_max, sampled)
    t_alloc = t_curve[0] + (1.0 + premium) * (t_curve - t_curve[0])
    if margin >= 0:
        g_drain = np.empty_like(g)
        base_n = kern.drain_gains(g, cap, margin, g_drain)
        ks, V, lam2, _ = kern.allocate_base(g_drain, v_max, t_alloc if premium else t_curve, base_n)
    else:
        ks, V, lam2, _ = kern.allocate(g, v_max, t_alloc if premium else t_curve)
    kb = np.minimum(kbase, avail[:, bp]) if bp >= 0 else np.zeros(n, dtype=np.int64)
    Vb = int(kb.sum())
    same, e_ctrl, var, e_base = kern.guard_terms(g, gains, ks, kb, choice, bp)
    bi = buf.ints[:n]
    for a, b in (
        (buf.drafts[:n], drafts),
        (buf.alpha[:n], alpha),
        (buf.g[:n], g),
        (bi[:, :p], avail),
        (bi[:, p : 2 * p], match),
        (bi[:, 2 * p : 3 * p], cells),
        (bi[:, buf.c_choice], choice),
        (bi[:, buf.c_kb], kb),
        (bi[:, buf.c_played], choice),
        (bi[:, buf.c_ks], ks),
        (bi[:, buf.c_pos], pos),
        (bi[:, buf.c_slots], slots),
    ):
        np.testing.assert_array_equal(a, b)
    assert got[:9] == (v_max, V, lam2, Vb, same, e_ctrl, var, e_base, t_curve[V])
    if Vb <= v_max:
        assert got[9] == t_curve[Vb]
    else:
        assert np.isnan(got[9])
    assert got[10] == int((length[slots] != pos).sum())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), k=st.integers(1, 6), seed=st.integers(0, 100_000))
def test_fused_observation_kernel_equals_its_parts(n, k, seed):
    """``observe_step`` (one call per observation) changes the counts, histories and the safety
    tracker exactly as registering the decision's baseline drafts, learning, committing and
    resolving one after another."""
    from adaptive_spec.core.safety import BaselineTracker

    rng = np.random.default_rng(seed)
    P, S = 2, 12
    drafts = rng.integers(0, 3, size=(n, P, k)).astype(np.int64)
    avail = rng.integers(0, k + 1, size=(n, P)).astype(np.int64)
    cells = rng.integers(0, 6, size=(n, P)).astype(np.int64)
    slots = rng.permutation(S)[:n].astype(np.int64)
    pos = np.zeros(n, dtype=np.int64)
    ks = rng.integers(0, k + 1, size=n).astype(np.int64)
    kb = np.where(rng.random(n) < 0.5, ks, rng.integers(0, k + 1, size=n)).astype(np.int64)
    choice = rng.integers(0, P, size=n).astype(np.int64)
    bp = int(rng.integers(-1, P))
    all_same = bool(rng.random() < 0.2)
    rows = np.flatnonzero(rng.random(n) < 0.8).astype(np.int64)
    lens = rng.integers(1, k + 2, size=rows.size).astype(np.int64)
    tok = rng.integers(0, 3, size=int(lens.sum())).astype(np.int64)
    fin = rows[rng.random(rows.size) < 0.3]

    def state():
        tr = BaselineTracker(k)
        tr.ensure(S)
        for i in range(n):  # pending baseline drafts at each slot's current position
            tr.add_drafts(i, slots[i : i + 1], np.zeros(1, np.int64), drafts[i, :1], avail[i, :1])
        return (np.zeros((6, k)), np.zeros((6, k)), np.zeros((S, P)), np.zeros((S, P)),
                np.zeros((S, P), np.int64), tr)  # fmt: skip

    base_time = float("nan") if rng.random() < 0.2 else float(rng.uniform(0.01, 0.1))
    run_tokens, run_time = float(lens.sum()), 0.05
    acc, tri, hr, hn, hb, tr = state()
    counts = np.stack([acc, tri])  # the acceptance counts as the controller passes them
    acc, tri = counts[0], counts[1]
    for i in range(n):  # the earlier decisions' times are known
        tr.set_step_times(i, 0.02 * (i + 1), 1.0, 0.02)
    resolved = np.zeros(4)
    ints = np.concatenate([rows, lens, fin, tok])
    tr._reserve(n)
    buf = kern.StepBuffers(P, k)
    buf.ensure(n)
    buf.drafts[:n] = drafts
    bi = buf.ints
    bi[:n, :P], bi[:n, 2 * P : 3 * P] = avail, cells
    bi[:n, buf.c_kb], bi[:n, buf.c_played], bi[:n, buf.c_ks] = kb, choice, ks
    bi[:n, buf.c_pos], bi[:n, buf.c_slots] = pos, slots
    out = kern.observe_step(
        kern.Observation(ints, rows.size, fin.size, base_time, run_tokens, run_time), n, n, bp,
        all_same, buf.arrays, kern.Learning(acc, tri, 0.99, hr, hn, hb, 0.3, 0.2, 0.6),
        tr.tracked(resolved), tr.n_pending,
    )  # fmt: skip
    acc2, tri2, hr2, hn2, hb2, tr2 = state()
    for i in range(n):
        tr2.set_step_times(i, 0.02 * (i + 1), 1.0, 0.02)
    decided = kern.Decided(drafts, avail, cells, choice, ks, kb, pos, slots)
    same = tr2.register(n, decided, bp, all_same)
    learning = kern.Learning(acc2, tri2, 0.99, hr2, hn2, hb2, 0.3, 0.2, 0.6)
    want = kern.learn(rows, lens, tok, decided, learning)
    tr2.commit_flat(slots[rows], lens, tok)
    f = np.zeros(tr2.ring.shape[0], dtype=bool)
    f[slots[fin]] = True
    if base_time == base_time:  # the step's time known: its record gets it
        tr2.set_step_times(n, base_time, run_tokens, run_time, float(lens[same[rows]].sum()))
    resolved2 = np.zeros(4)
    closed = tr2.resolve(f, into=resolved2)
    if base_time != base_time:  # no valid step time: its record was dropped
        assert tr.record(n) is None and all(s != n for s, _ in closed)
    assert out[0] == want[0].size
    for a, b in zip(buf.learned[:, : out[0]], want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert out[1] == tr2.n_pending
    for a, b in zip(tr.pending_drafts, tr2.pending_drafts, strict=True):
        np.testing.assert_array_equal(a[: tr2.n_pending], b[: tr2.n_pending])
    np.testing.assert_array_equal(resolved, resolved2)
    for i in range(n + 1):
        if i < n or base_time == base_time:
            assert tr.record(i) == tr2.record(i)
    for a, b in ((acc, acc2), (tri, tri2), (hr, hr2), (hn, hn2), (hb, hb2)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(tr.ring, tr2.ring)
    np.testing.assert_array_equal(tr.length, tr2.length)


def test_a_rest_step_runs_no_proposer_and_no_decision_but_observes_the_outcome():
    """The step driver on a rest step: every request plays none without a proposer or ``decide``
    being called; the outcome (every request's committed tokens) still reaches ``observe``."""
    from adaptive_spec.core.driver import LiveRequest, StepDriver, VerifiedRequest
    from adaptive_spec.proposers.ngram import NgramProposer

    class Resting(SpecPolicy):
        name = "resting"

        def __init__(self) -> None:
            super().__init__(["ngram"], 4)
            self.resting = True
            self.observed: list[StepOutcome] = []

        def rests(self, batch_size: int) -> bool:
            return self.resting

        def decide(self, view: StepView) -> Decision:
            n = len(view.requests)
            return Decision([Arm("ngram", 2)] * n, [1.0] * n, [[] for _ in range(n)])

        def observe(self, outcome: StepOutcome) -> None:
            self.observed.append(outcome)

    class Counting(NgramProposer):
        calls = 0

        def propose(self, reqs, ks):
            Counting.calls += 1
            return super().propose(reqs, ks)

    policy = Resting()
    driver = StepDriver(policy, {"ngram": Counting(max_k=4)}, max_k=4, vocab_size=100)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    for rid in ("a", "b"):
        driver.add_request(rid, prompt)
    live = [LiveRequest("a", 0, 16, 0.0), LiveRequest("b", 0, 16, 0.0)]
    dec = driver.decide(live, batch_size=2)
    assert Counting.calls == 0 and dec.arms == [NO_SPEC, NO_SPEC] and dec.drafts == [[], []]
    out = driver.observe(
        [VerifiedRequest("a", 0, 0, [8]), VerifiedRequest("b", 0, 0, [9])],
        step_time_s=0.02,
        batch_size=2,
        num_verified_tokens=0,
    )
    assert [o.emitted_token_ids for o in policy.observed[0].requests] == [[8], [9]]
    assert [o.arm for o in out.requests] == [NO_SPEC, NO_SPEC]
    policy.resting = False  # a regular step: the proposer runs and the decision is played
    dec = driver.decide([LiveRequest("a", 1, 15, 0.0), LiveRequest("b", 1, 15, 0.0)], batch_size=2)
    assert Counting.calls == 1 and dec.arms[0] == Arm("ngram", 2) and len(dec.drafts[0]) == 2


def test_a_step_with_the_drafter_s_drafts_is_never_a_rest_step():
    """Drafts the engine's drafter already made are paid for: the driver decides in full on that step
    even when the policy would rest (how a resting policy sees the drafter's drafts again)."""
    from adaptive_spec.core.driver import LiveRequest, StepDriver

    class Resting(SpecPolicy):
        name = "resting"
        asked = 0

        def rests(self, batch_size: int) -> bool:
            Resting.asked += 1
            return True

        def decide(self, view: StepView) -> Decision:
            n = len(view.requests)
            return Decision([Arm("draft", 2)] * n, [1.0] * n, [[] for _ in range(n)])

    driver = StepDriver(Resting(["draft"], 4), {}, max_k=4, vocab_size=100, external=["draft"])
    driver.add_request("a", [5, 6, 7])
    live = [LiveRequest("a", 0, 16, 0.0)]
    dec = driver.decide(live, batch_size=1, external_drafts={"draft": {"a": [9, 10, 11]}})
    assert Resting.asked == 0 and dec.arms == [Arm("draft", 2)] and dec.drafts == [[9, 10]]
    dec = driver.decide(live, batch_size=1, external_drafts={"draft": {}})  # none made: rests
    assert Resting.asked == 1 and dec.arms == [NO_SPEC]


def test_acceptance_counts_stay_one_array_in_a_copy():
    """The acceptance counts the kernels update (``counts4``) are views of the model's own array,
    in a deep copy too: learning through them reaches ``acc`` / ``tri`` and the copy does not share
    the original's counts."""
    import copy

    from adaptive_spec.core.acceptance import AcceptanceModel

    m = AcceptanceModel(["ngram"], 4)
    m.acc = 1.0
    c = copy.deepcopy(m)
    c.counts4[0, 0, 0] += 2.0
    c.counts4[1, 0, 0] += 5.0
    assert c.acc.reshape(-1, 4)[0, 0] == 3.0 and c.tri.reshape(-1, 4)[0, 0] == 5.0
    assert m.acc.reshape(-1, 4)[0, 0] == 1.0 and m.tri.reshape(-1, 4)[0, 0] == 0.0
    assert np.shares_memory(m.counts4, m.acc) and not np.shares_memory(c.counts4, m.acc)


def _play_jacobi(ctrl: AdaptiveController, steps: int, accepted: int, batch: int = 4) -> int:
    """Steps in which every request offers a Jacobi draft and drafts are nearly free, so the
    controller plays it; each request that plays it has ``accepted`` draft tokens accepted. Returns
    the request-steps that played Jacobi."""
    played = 0
    for t in range(steps):
        views = [
            RequestView(f"r{i}", t, 1000, 0.0, {"jacobi": np.array([7, 7, 7])}, {"jacobi": 3})
            for i in range(batch)
        ]
        dec = ctrl.decide(StepView(views, batch))
        outs = []
        for i, a in enumerate(dec.arms):
            if a.proposer == "jacobi" and a.k > 0:
                played += 1
                acc = min(accepted, a.k)
                outs.append(RequestOutcome(f"r{i}", a, a.k, acc, [7] * (acc + 1), False))
            else:
                outs.append(RequestOutcome(f"r{i}", a, 0, 0, [1], False))
        ctrl.observe(StepOutcome(outs, 0.02, batch, sum(o.drafted for o in outs)))
    return played


def test_jacobi_full_shadow_rate_needs_accepted_tokens_not_plays():
    """Played Jacobi drafts that the target rarely accepts do not keep Jacobi's shadow samples at the
    full rate (a shadow guess that the allocation plays would otherwise keep it there for good);
    a moving acceptance rate of its played draft tokens of at least 0.2 does, for 256 steps."""
    vs = np.array([0, 1, 8])
    table = StepCostTable.from_samples([4, 4, 4], vs, 0.02 + 1e-6 * vs)
    fresh = AdaptiveController(["jacobi"], 4, cost_table=table, shadow_every=4, baseline="none")
    ctrl = AdaptiveController(["jacobi"], 4, cost_table=table, shadow_every=4, baseline="none")
    ctrl.acceptance.load_state_dict(fresh.acceptance.state_dict())
    assert ctrl._shadow_interval() == 32
    assert _play_jacobi(ctrl, 20, accepted=0) > 0  # played, never accepted
    assert ctrl._shadow_interval() == 32
    assert _play_jacobi(ctrl, 1, accepted=1) > 0  # a lucky token: the rate moves to about 0.03
    assert ctrl._shadow_interval() == 32
    assert _play_jacobi(ctrl, 8, accepted=3) > 0  # every played token accepted: the rate passes 0.2
    assert ctrl._shadow_interval() == 4
    _play_jacobi(ctrl, 300, accepted=0)  # 256 steps after it last paid: back to the low rate
    assert ctrl._shadow_interval() == 32


def test_drain_gains_keep_only_the_requests_near_the_largest_budget():

    g = np.array([[0.9, 0.5], [0.8, 0.4], [0.7, -np.inf], [0.6, 0.3]])
    cap = np.array([40, 38, 37, 10], dtype=np.int64)
    out = np.empty_like(g)
    assert kern.drain_gains(g, cap, 2, out) == 2.0
    np.testing.assert_array_equal(out[:2], g[:2])
    assert np.isneginf(out[2:]).all()
    assert kern.drain_gains(g, cap, 100, out) == 4.0
    np.testing.assert_array_equal(out, g)
    # allocate_base counts the kept requests only; each draft token adds 30 % to the step
    t = np.array([1.0, 1.3, 1.6, 1.9, 2.2])
    ks, V, _, _ = kern.allocate_base(out, 4, t, 4.0)
    assert V == 0  # (4 + 0.9) / 1.3 < 4: not worth it when every request counts
    kern.drain_gains(g, cap, 0, out)
    ks, V, _, _ = kern.allocate_base(out, 4, t, 1.0)
    assert ks.tolist() == [2, 0, 0, 0]  # (1 + 0.9 + 0.5) / 1.6 > 1: the critical request drafts


def _cheap_table(max_b: int = 32) -> StepCostTable:
    """A table where the first draft token adds 8 % to a step and each further one 1 %."""
    bs = [1, 2, 4, 8, 16, 32]
    vs = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    sec = np.array([[0.03 * (1 + (0.08 + 0.01 * (v - 1) if v else 0.0)) for v in vs] for _ in bs])
    return StepCostTable(bs, vs, sec, counts=np.full(sec.shape, 100.0))


def test_a_draining_batch_drafts_for_the_requests_that_end_last():
    """16 requests with good n-gram drafts; one has 40 tokens left, the others 5-20. While requests
    wait, the allocation may draft for every request; once none waits, only the one that decides when
    the batch ends drafts (its tokens are worth a whole step each there), and with drain_margin=None
    the draining batch is allocated as before."""
    budgets = [40] + [5 + i for i in range(15)]

    def decide(queue_len: int, margin: int | None) -> list[int]:
        ctrl = AdaptiveController(
            ["ngram"],
            4,
            cost_table=_cheap_table(),
            drain_margin=margin,
            baseline="none",
            alpha=0.99,
        )
        ctrl.acceptance.counts4[0][...] = 0.9 * 50  # acceptance 0.9 everywhere, well measured
        ctrl.acceptance.counts4[1][...] = 50
        ctrl.acceptance.counts_changed()
        views = [
            RequestView(f"r{i}", 10, b, 0.0, {"ngram": np.arange(4)}, {"ngram": 4})
            for i, b in enumerate(budgets)
        ]
        return [a.k for a in ctrl.decide(StepView(views, 16, queue_len=queue_len)).arms]

    drained = decide(0, 2)
    assert drained[0] == 4 and sum(drained[1:]) == 0
    assert decide(0, None) == decide(3, 2)
    assert sum(decide(3, 2)[1:]) > 0  # with a queue every request's tokens count


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_drain_margin_is_checked(bad):
    with pytest.raises(ValueError, match="drain_margin="):
        AdaptiveController(["ngram"], 4, drain_margin=bad)
