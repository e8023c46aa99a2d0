"""One generic suite that every registered policy passes (river's ``_unit_test_params`` pattern)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from adaptive_spec.bandits import POLICIES, Policy, available_policies, make_policy, policy_class

ARMS: list[Any] = ["none", 3, "draft-k4"]
CASES = [
    pytest.param(name, params, id=f"{name}-{i}")
    for name in available_policies()
    for i, params in enumerate(POLICIES[name]._unit_test_params())
]


def _contexts(policy: Policy, n: int, rng: np.random.Generator) -> np.ndarray | None:
    return rng.normal(size=(n, policy.dim)) if policy.contextual else None


def _rewards(policy: Policy, n: int, rng: np.random.Generator) -> np.ndarray:
    """Valid rewards for ``policy`` (binary for logistic TS, inside reward_range when set)."""
    if policy.name == "logistic-ts":
        return (rng.random(n) < 0.5).astype(float)
    lo, hi = policy.reward_range or (-2.0, 3.0)
    return lo + (hi - lo) * rng.random(n)


def _step(policy: Policy, rng: np.random.Generator, n: int = 8) -> list[Any]:
    """One engine step: a batch of pulls and its outcomes (full information for Hedge)."""
    X = _contexts(policy, n, rng)
    arms = policy.pull_batch(X, n=None if policy.contextual else n)
    if policy.full_information_only:
        R = np.stack([_rewards(policy, policy.n_arms, rng) for _ in range(n)])
        policy.update_full(R, X)
    else:
        policy.update_batch(arms, _rewards(policy, n, rng), X)
    return arms


def _single_context(policy: Policy) -> np.ndarray | None:
    return np.linspace(-1.0, 1.0, policy.dim) if policy.contextual else None


def test_registry_lists_every_policy_from_the_brief() -> None:
    expected = {
        "ucb1",
        "kl-ucb",
        "exp3",
        "epsilon-greedy",
        "thompson-beta",
        "thompson-gaussian",
        "linucb",
        "linucb-hybrid",
        "hedge",
        "sw-ucb",
        "discounted-thompson",
    }
    assert expected <= set(available_policies())
    for name, cls in POLICIES.items():
        assert cls.name == name and policy_class(name) is cls


def test_unknown_policy_name_lists_the_allowed_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown policy 'ucb2'; allowed: .*discounted-thompson.*ucb1"
    ):
        make_policy("ucb2", ARMS)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_pull_and_update_verbs(name: str, params: dict) -> None:
    rng = np.random.default_rng(0)
    policy = make_policy(name, ARMS, seed=1, **params)
    assert policy.arms == ARMS and policy.n_arms == 3
    assert policy.pull(_single_context(policy)) in ARMS
    for _ in range(30):
        arms = _step(policy, rng)
        assert len(arms) == 8 and all(a in ARMS for a in arms)
    per_round = 3 if policy.full_information_only else 1
    assert policy.n_updates == 30 * 8 * per_round == policy.counts.sum()
    idx = policy.pull_batch_indices(_contexts(policy, 5, rng), n=None if policy.contextual else 5)
    assert idx.dtype == np.int64 and idx.shape == (5,) and ((idx >= 0) & (idx < 3)).all()
    assert policy.pull_batch(_contexts(policy, 0, rng), n=None if policy.contextual else 0) == []
    if not policy.full_information_only:
        policy.update(ARMS[1], float(_rewards(policy, 1, rng)[0]), _single_context(policy))
    state = json.dumps(policy.state_dict())
    assert "NaN" not in state and "Infinity" not in state


@pytest.mark.parametrize(("name", "params"), CASES)
def test_seeded_runs_are_reproducible_and_state_round_trips_exactly(
    name: str, params: dict
) -> None:
    a = make_policy(name, ARMS, seed=7, **params)
    b = make_policy(name, ARMS, seed=7, **params)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    for _ in range(20):
        assert _step(a, rng_a) == _step(b, rng_b)
    state = json.loads(json.dumps(a.state_dict()))
    clone = Policy.from_state_dict(state)
    assert type(clone) is type(a)
    assert clone.state_dict() == a.state_dict()
    in_place = make_policy(name, ARMS, seed=99, **params)
    in_place.load_state_dict(state)
    rng_a, rng_c, rng_d = (np.random.default_rng(11) for _ in range(3))
    for _ in range(10):
        expected = _step(a, rng_a)
        assert _step(clone, rng_c) == expected
        assert _step(in_place, rng_d) == expected
    assert clone.state_dict() == a.state_dict() == in_place.state_dict()
    if a.has_probabilities:
        ctx = _single_context(a)
        np.testing.assert_array_equal(clone.probabilities(ctx), a.probabilities(ctx))


@pytest.mark.parametrize(("name", "params"), CASES)
def test_probabilities_are_a_distribution_or_refused(name: str, params: dict) -> None:
    rng = np.random.default_rng(2)
    policy = make_policy(name, ARMS, seed=0, **params)
    for _ in range(10):
        _step(policy, rng)
    ctx = _single_context(policy)
    if not policy.has_probabilities:
        with pytest.raises(NotImplementedError, match="no closed-form"):
            policy.probabilities(ctx)
        return
    p = policy.probabilities(ctx)
    assert p.shape == (3,) and (p >= 0).all() and p.sum() == pytest.approx(1.0, abs=1e-12)
    X = _contexts(policy, 6, rng)
    P = policy.probabilities_batch(X, n=None if policy.contextual else 6)
    assert P.shape == (6, 3) and (P >= 0).all()
    np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
    # Pulls follow the stated distribution (one fixed context, many requests).
    n = 6000
    Xn = None if ctx is None else np.tile(ctx, (n, 1))
    idx = policy.pull_batch_indices(Xn, n=None if policy.contextual else n)
    freq = np.bincount(idx, minlength=3) / n
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))


# Hedge takes full information only; EXP3 weights a batch by the probabilities it was drawn with.
@pytest.mark.parametrize(
    ("name", "params"), [c for c in CASES if c.values[0] not in ("hedge", "exp3")]
)
def test_update_batch_equals_sequential_updates(name: str, params: dict) -> None:
    rng = np.random.default_rng(5)
    batched = make_policy(name, ARMS, seed=0, **params)
    single = make_policy(name, ARMS, seed=0, **params)
    for _ in range(5):
        n = 12
        arms = [ARMS[i] for i in rng.integers(0, 3, n)]
        r = _rewards(batched, n, rng)
        X = _contexts(batched, n, rng)
        batched.update_batch(arms, r, X)
        for j in range(n):
            single.update(arms[j], float(r[j]), None if X is None else X[j])
    sb, ss = batched.state_dict(), single.state_dict()
    assert sb["counts"] == ss["counts"]
    if name == "logistic-ts":
        return  # Algorithm 3 is defined per batch: one batch is not the same as 12 batches of 1.
    for key, value in sb["data"].items():
        np.testing.assert_allclose(np.asarray(value), np.asarray(ss["data"][key]), rtol=1e-9)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_bad_input_raises_value_error_and_changes_nothing(name: str, params: dict) -> None:
    rng = np.random.default_rng(4)
    policy = make_policy(name, ARMS, seed=0, **params)
    _step(policy, rng)
    before = policy.state_dict()
    ctx = _single_context(policy)
    good_r = float(_rewards(policy, 1, rng)[0])
    full = policy.full_information_only
    bad: list[tuple[Any, str]] = [
        (lambda: policy.update_full(np.full(4, good_r), ctx), r"rewards_per_arm must have shape"),
        (lambda: policy.update_full(np.array([good_r, np.nan, good_r]), ctx), "finite"),
        (lambda: policy.update_full(np.array([good_r, np.inf, good_r]), ctx), "finite"),
        (lambda: policy.pull_batch(_contexts(policy, 2, rng), n=-1), "n must be an integer >= 0"),
    ]
    if not full:
        bad += [
            (lambda: policy.update("unknown-arm", good_r, ctx), "arm 'unknown-arm' is not one"),
            (lambda: policy.update(ARMS[0], float("nan"), ctx), "reward must be finite"),
            (lambda: policy.update(ARMS[0], float("inf"), ctx), "reward must be finite"),
            (
                lambda: policy.update_batch(
                    ARMS, [good_r, np.nan, good_r], _contexts(policy, 3, rng)
                ),
                "rewards must be finite",
            ),
            (
                lambda: policy.update_batch(ARMS, [good_r] * 2, _contexts(policy, 3, rng)),
                r"rewards must have shape \[3\]",
            ),
            (lambda: policy.update_batch([ARMS[0], True], [good_r] * 2, None), "not one"),
        ]
    else:
        with pytest.raises(NotImplementedError, match="update_full"):
            policy.update(ARMS[0], good_r)
        with pytest.raises(NotImplementedError, match="update_full"):
            policy.update_batch(ARMS, [good_r] * 3)
    if policy.reward_range is not None:
        lo, hi = policy.reward_range
        bad.append((lambda: policy.update_full(np.full(3, hi + 1.0), ctx), "reward_range"))
        if not full:
            bad.append((lambda: policy.update(ARMS[0], lo - 0.5, ctx), "reward_range"))
    if policy.contextual:
        d = policy.dim
        bad += [
            (lambda: policy.pull(None), "context is required"),
            (lambda: policy.pull(np.ones(d + 1)), rf"context must have shape \[{d}\]"),
            (lambda: policy.pull(np.full(d, np.nan)), "context must be finite"),
            (
                lambda: policy.pull_batch(np.ones((2, d + 1))),
                rf"contexts must have shape \[n, {d}\]",
            ),
            (lambda: policy.pull_batch(None), "contexts are required"),
            (lambda: policy.update_full(np.full(3, good_r), None), "context is required"),
        ]
        if not full:
            bad += [
                (lambda: policy.update(ARMS[0], good_r, None), "context is required"),
                (lambda: policy.update(ARMS[0], good_r, np.ones(d + 2)), "context must have shape"),
                (lambda: policy.update_batch(ARMS, [good_r] * 3, np.ones((2, d))), "rows"),
            ]
    else:
        bad += [
            (lambda: policy.pull_batch(None), "give contexts"),
            (lambda: policy.pull(np.array([1.0, np.nan])), "context must be finite"),
            (lambda: policy.pull_batch(np.ones((2, 3)), n=5), "does not match"),
        ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
    assert policy.state_dict() == before


@pytest.mark.parametrize("name", available_policies())
def test_bad_arms_and_states_are_rejected(name: str) -> None:
    params = next(iter(POLICIES[name]._unit_test_params()))
    params = {k: v for k, v in params.items() if k != "arm_features"}
    for arms, match in [
        ([], "at least one"),
        (["a", "a"], "distinct"),
        ([True, "b"], "bool"),
        ([("a", 1), "b"], "str or int"),
        ("abc", "list of arm ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_policy(name, arms, **params)
    with pytest.raises(ValueError, match="seed"):
        make_policy(name, ARMS, seed=-3, **params)
    policy = make_policy(name, ARMS, **params)
    other = make_policy("ucb1" if name != "ucb1" else "kl-ucb", ARMS)
    with pytest.raises(ValueError, match="expected"):
        policy.load_state_dict(other.state_dict())
    state = policy.state_dict()
    first_key = next(iter(state["data"]))
    broken = {**state, "data": {**state["data"], first_key: [1.0]}}
    with pytest.raises(ValueError, match="state"):
        policy.load_state_dict(broken)
    assert policy.state_dict() == state
    if policy.contextual:
        with pytest.raises(ValueError, match="dim"):
            make_policy(name, ARMS, **{**params, "dim": 0})
    else:
        with pytest.raises(TypeError, match="dim"):
            make_policy(name, ARMS, dim=3, **params)


@pytest.mark.parametrize("name", available_policies())
def test_a_single_arm_is_always_pulled(name: str) -> None:
    params = next(iter(POLICIES[name]._unit_test_params()))
    params = {k: v for k, v in params.items() if k != "arm_features"}
    policy = make_policy(name, [42], seed=0, **params)
    rng = np.random.default_rng(0)
    for _ in range(3):
        X = _contexts(policy, 4, rng)
        assert policy.pull_batch(X, n=None if policy.contextual else 4) == [42] * 4
        if policy.full_information_only:
            policy.update_full(_rewards(policy, 4, rng)[:, None], X)
        else:
            policy.update_batch([42] * 4, _rewards(policy, 4, rng), X)
    if policy.has_probabilities:
        assert policy.probabilities(_single_context(policy)).tolist() == [1.0]


@pytest.mark.parametrize(("name", "params"), CASES)
def test_many_updates_stay_finite_and_normalised(name: str, params: dict) -> None:
    """10^6 observations (10^5 rounds for the contextual ones) through the batch verbs."""
    rng = np.random.default_rng(8)
    policy = make_policy(name, ARMS, seed=0, **params)
    total = 100_000 if policy.contextual else 1_000_000
    batch = 100_000 if policy.contextual else 250_000
    for _ in range(total // batch):
        if policy.full_information_only:
            policy.update_full(np.stack([_rewards(policy, batch, rng) for _ in range(3)], axis=1))
            continue
        X = _contexts(policy, batch, rng)
        idx = rng.integers(0, 3, batch)
        r = _rewards(policy, batch, rng)
        if policy.contextual:  # make one arm clearly better so the models move
            r = np.where(idx == 0, np.maximum(r, 1.0 if name == "logistic-ts" else r.max()), r)
        policy.update_batch([ARMS[i] for i in idx], r, X)
    per = 3 if policy.full_information_only else 1
    assert policy.n_updates == total * per
    state = policy.state_dict()
    arrays = [np.asarray(v, dtype=float) for v in state["data"].values() if v is not None]
    flat = np.concatenate([a.ravel() for a in arrays])
    assert np.isfinite(flat).all()
    X = _contexts(policy, 64, rng)
    assert len(policy.pull_batch(X, n=None if policy.contextual else 64)) == 64
    if policy.has_probabilities:
        P = policy.probabilities_batch(X, n=None if policy.contextual else 64)
        assert np.isfinite(P).all()
        np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
