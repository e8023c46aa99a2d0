"""Each policy's statistics and decision rule against a direct computation of its paper's formula."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from adaptive_spec.bandits import LogisticThompson, make_policy
from adaptive_spec.bandits.kl_ucb import bernoulli_kl, kl_upper_bound
from adaptive_spec.bandits.stats import ArmSums
from scipy.optimize import brentq
from scipy.special import softmax


@pytest.mark.parametrize("budget", [0.0, 1e-12, 1e-6, 1e-3, 0.05, 0.5, 3.0, 30.0])
def test_kl_upper_bound_solves_the_kl_equation(budget: float) -> None:
    means = np.array([0.0, 1e-9, 0.01, 0.2, 0.5, 0.8, 0.99, 0.999999, 1.0])
    got = kl_upper_bound(means, budget)
    for p, q in zip(means, got, strict=True):
        if p == 1.0:
            assert q == 1.0
            continue

        def f(x: float, p: float = p) -> float:
            return float(bernoulli_kl(np.array(p), np.array(x))) - budget

        if budget == 0.0:
            ref = p
        elif f(1 - 1e-12) <= 0:
            ref = 1 - 1e-12
        else:
            ref = brentq(f, p, 1 - 1e-12, xtol=1e-15)
        assert q == pytest.approx(ref, abs=1e-9)


def _feed(policy, stream) -> None:
    for arm, reward in stream:
        policy.update(arm, reward)


def _stream(rng: np.random.Generator, n: int, k: int = 3) -> list[tuple[int, float]]:
    return [(int(rng.integers(0, k)), float(rng.random())) for _ in range(n)]


def test_ucb1_tuned_and_kl_indices_match_their_formulas() -> None:
    rng = np.random.default_rng(0)
    stream = _stream(rng, 200)
    arms = np.array([a for a, _ in stream])
    r = np.array([x for _, x in stream])
    t = len(stream)
    n = np.bincount(arms, minlength=3)
    mean = np.bincount(arms, r, minlength=3) / n
    var = np.bincount(arms, r * r, minlength=3) / n - mean**2
    ucb1 = make_policy("ucb1", [0, 1, 2], c=0.7)
    tuned = make_policy("ucb-tuned", [0, 1, 2])
    kl = make_policy("kl-ucb", [0, 1, 2], c=3.0)
    for p in (ucb1, tuned, kl):
        _feed(p, stream)
    np.testing.assert_allclose(
        ucb1._scores(None, 1), mean + 0.7 * np.sqrt(2 * math.log(t) / n), rtol=1e-12
    )
    v = var + np.sqrt(2 * math.log(t) / n)
    np.testing.assert_allclose(
        tuned._scores(None, 1), mean + np.sqrt(math.log(t) / n * np.minimum(0.25, v)), rtol=1e-12
    )
    budget = (math.log(t) + 3.0 * math.log(math.log(t))) / n
    np.testing.assert_allclose(kl._scores(None, 1), kl_upper_bound(mean, budget), rtol=1e-12)
    assert np.all(bernoulli_kl(mean, kl._scores(None, 1)) * n <= budget * n + 1e-9)


def test_reward_range_rescales_rewards_to_the_unit_interval() -> None:
    rng = np.random.default_rng(1)
    stream = _stream(rng, 50)
    unit = make_policy("ucb1", [0, 1, 2])
    wide = make_policy("ucb1", [0, 1, 2], reward_range=(-5.0, 5.0))
    _feed(unit, stream)
    _feed(wide, [(a, 10.0 * x - 5.0) for a, x in stream])
    np.testing.assert_allclose(wide._scores(None, 1), unit._scores(None, 1), rtol=1e-12)


def test_thompson_posteriors_match_conjugate_formulas() -> None:
    rng = np.random.default_rng(2)
    stream = _stream(rng, 100)
    arms = np.array([a for a, _ in stream])
    r = np.array([x for _, x in stream])
    beta = make_policy("thompson-beta", [0, 1, 2], alpha0=2.0, beta0=0.5)
    gauss = make_policy(
        "thompson-gaussian", [0, 1, 2], prior_mean=0.2, prior_var=2.0, noise_var=0.3
    )
    _feed(beta, stream)
    _feed(gauss, stream)
    s = np.bincount(arms, r, minlength=3)
    n = np.bincount(arms, minlength=3)
    a, b = beta.posterior
    np.testing.assert_allclose(a, 2.0 + s, rtol=1e-12)
    np.testing.assert_allclose(b, 0.5 + n - s, rtol=1e-12)
    prec = 1 / 2.0 + n / 0.3
    m, v = gauss.posterior
    np.testing.assert_allclose(m, (0.2 / 2.0 + s / 0.3) / prec, rtol=1e-12)
    np.testing.assert_allclose(v, 1 / prec, rtol=1e-12)
    # Draws follow the posterior.
    draws = gauss._scores(None, 20000)
    assert np.all(np.abs(draws.mean(axis=0) - m) < 5 * np.sqrt(v / 20000))
    np.testing.assert_allclose(draws.var(axis=0), v, rtol=0.05)
    bdraws = beta._scores(None, 20000)
    np.testing.assert_allclose(bdraws.mean(axis=0), a / (a + b), atol=0.01)


def test_epsilon_greedy_distribution_and_decay() -> None:
    policy = make_policy("epsilon-greedy", ["a", "b", "c"], epsilon=0.5, decay=0.1)
    np.testing.assert_allclose(policy.probabilities(), [1 / 3] * 3)  # nothing observed: all tie
    _feed(policy, [("a", 1.0), ("b", 2.0), ("c", 0.5), ("b", 1.5)])
    eps = 0.5 / (1 + 0.1 * 4)
    assert policy.current_epsilon == pytest.approx(eps)
    np.testing.assert_allclose(policy.probabilities(), [eps / 3, 1 - eps + eps / 3, eps / 3])


def test_exp3_updates_follow_auer_et_al() -> None:
    gamma, k = 0.2, 3
    policy = make_policy("exp3", [0, 1, 2], gamma=gamma, reward_range=(0.0, 2.0))
    log_w = np.zeros(k)
    rng = np.random.default_rng(3)
    for _ in range(50):
        p = (1 - gamma) * softmax(log_w) + gamma / k
        np.testing.assert_allclose(policy.probabilities(), p, rtol=1e-12)
        arm, reward = int(rng.integers(0, k)), float(2 * rng.random())
        log_w[arm] += gamma * (reward / 2.0) / (p[arm] * k)
        policy.update(arm, reward)
    full = np.array([2.0, 0.0, 1.0])
    policy.update_full(full)
    log_w += gamma * (full / 2.0) / k
    np.testing.assert_allclose(
        policy.probabilities(), (1 - gamma) * softmax(log_w) + gamma / k, rtol=1e-12
    )
    tuned = make_policy("exp3", list(range(5)), horizon=10_000)
    assert tuned.gamma == pytest.approx(math.sqrt(5 * math.log(5) / ((math.e - 1) * 10_000)))
    with pytest.raises(ValueError, match="not both"):
        make_policy("exp3", [0, 1], gamma=0.1, horizon=10)


def test_hedge_probabilities_are_exponential_weights_with_the_anytime_rate() -> None:
    policy = make_policy("hedge", ["x", "y", "z"])
    rng = np.random.default_rng(4)
    gains = np.zeros(3)
    for t in range(1, 40):
        eta = math.sqrt(8 * math.log(3) / t)
        np.testing.assert_allclose(policy.probabilities(), softmax(eta * gains), rtol=1e-12)
        r = rng.random(3)
        gains += r
        policy.update_full(r)
    batch = rng.random((10, 3))
    policy.update_full(batch)
    eta = math.sqrt(8 * math.log(3) / 50)
    np.testing.assert_allclose(
        policy.probabilities(), softmax(eta * (gains + batch.sum(axis=0))), rtol=1e-12
    )
    fixed = make_policy("hedge", ["x", "y"], eta=0.5)
    fixed.update_full([1.0, 0.0])
    np.testing.assert_allclose(fixed.probabilities(), softmax([0.5, 0.0]), rtol=1e-12)


def test_sliding_window_statistics_equal_a_recount_of_the_window() -> None:
    rng = np.random.default_rng(5)
    window = 37
    policy = make_policy("sw-ucb", [0, 1, 2, 3], window=window, xi=1.0)
    history: list[tuple[int, float]] = []
    for n in [1, 5, 36, 37, 60, 3, 100, 1, 1, 40] * 3:
        idx = rng.integers(0, 4, n)
        r = rng.random(n)
        policy.update_batch(idx.tolist(), r)
        history += list(zip(idx.tolist(), r.tolist(), strict=True))
        last = history[-window:]
        counts = np.bincount([a for a, _ in last], minlength=4)
        sums = np.bincount([a for a, _ in last], [x for _, x in last], minlength=4)
        np.testing.assert_array_equal(policy.stats.counts, counts)
        np.testing.assert_allclose(policy.stats.sums, sums, atol=1e-12)
        horizon = min(len(history), window)
        with np.errstate(divide="ignore", invalid="ignore"):
            expected = np.where(
                counts > 0, sums / counts + np.sqrt(math.log(horizon) / counts), np.inf
            )
        np.testing.assert_allclose(policy._scores(None, 1), expected, rtol=1e-9)


def test_discounted_statistics_equal_the_explicit_discounted_sums() -> None:
    rng = np.random.default_rng(6)
    gamma = 0.97
    sums = ArmSums(3, gamma=gamma)
    dts = make_policy("discounted-thompson", [0, 1, 2], gamma=gamma)
    history: list[tuple[int, float]] = []
    for n in (1, 4, 30, 2, 17):
        idx = rng.integers(0, 3, n)
        r = rng.random(n)
        sums.learn(idx, r)
        dts.update_batch(idx.tolist(), r)
        history += list(zip(idx.tolist(), r.tolist(), strict=True))
    t = len(history)
    w = np.array([gamma ** (t - 1 - s) for s in range(t)])
    a = np.array([x for x, _ in history])
    r = np.array([x for _, x in history])
    N = np.bincount(a, w, minlength=3)
    S = np.bincount(a, w * r, minlength=3)
    np.testing.assert_allclose(sums.counts, N, rtol=1e-9)
    np.testing.assert_allclose(sums.sums, S, rtol=1e-9)
    alpha, beta = dts.posterior
    np.testing.assert_allclose(alpha, 1 + S, rtol=1e-9)
    np.testing.assert_allclose(beta, 1 + N - S, rtol=1e-9)


def _data(rng: np.random.Generator, n: int, d: int, k: int):
    X = rng.normal(size=(n, d))
    idx = rng.integers(0, k, n)
    r = rng.normal(size=n)
    return X, idx, r


def test_linucb_is_a_per_arm_ridge_regression_with_its_confidence_width() -> None:
    rng = np.random.default_rng(7)
    d, k, reg = 4, 3, 0.5
    X, idx, r = _data(rng, 90, d, k)
    policy = make_policy("linucb", list(range(k)), dim=d, alpha=1.3, reg=reg)
    policy.update_batch(idx[:40].tolist(), r[:40], X[:40])
    policy.update_batch(idx[40:].tolist(), r[40:], X[40:])
    Xq = rng.normal(size=(5, d))
    expected = np.empty((5, k))
    for a in range(k):
        Xa, ra = X[idx == a], r[idx == a]
        A = reg * np.eye(d) + Xa.T @ Xa
        theta = np.linalg.solve(A, Xa.T @ ra)
        np.testing.assert_allclose(policy.theta[a], theta, rtol=1e-9)
        width = np.sqrt(np.einsum("nd,de,ne->n", Xq, np.linalg.inv(A), Xq))
        expected[:, a] = Xq @ theta + 1.3 * width
    np.testing.assert_allclose(policy._scores(Xq, 5), expected, rtol=1e-9)
    np.testing.assert_array_equal(policy.pull_batch_indices(Xq), expected.argmax(axis=1))


@pytest.mark.parametrize("with_features", [False, True])
def test_hybrid_linucb_equals_the_joint_ridge_regression(with_features: bool) -> None:
    """Algorithm 2's blockwise solution = ridge on phi(x, a) = [z_{x,a}, e_a (x) x]."""
    rng = np.random.default_rng(8)
    d, k, reg = 3, 4, 0.7
    F = rng.normal(size=(k, 2)) if with_features else None
    X, idx, r = _data(rng, 120, d, k)
    policy = make_policy("linucb-hybrid", list(range(k)), dim=d, arm_features=F, alpha=0.9, reg=reg)
    policy.update_batch(idx[:50].tolist(), r[:50], X[:50])
    policy.update_batch(idx[50:].tolist(), r[50:], X[50:])

    def phi(x: np.ndarray, a: int) -> np.ndarray:
        z = x if F is None else np.kron(F[a], x)
        block = np.zeros(k * d)
        block[a * d : (a + 1) * d] = x
        return np.concatenate([z, block])

    Phi = np.stack([phi(x, a) for x, a in zip(X, idx, strict=True)])
    A = reg * np.eye(Phi.shape[1]) + Phi.T @ Phi
    w = np.linalg.solve(A, Phi.T @ r)
    k_shared = d if F is None else 2 * d
    np.testing.assert_allclose(policy.beta, w[:k_shared], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(policy.theta.ravel(), w[k_shared:], rtol=1e-8, atol=1e-10)
    Xq = rng.normal(size=(6, d))
    mean, width = policy.predict(Xq)
    A_inv = np.linalg.inv(A)
    for j in range(6):
        for a in range(k):
            f = phi(Xq[j], a)
            assert mean[j, a] == pytest.approx(f @ w, rel=1e-8, abs=1e-10)
            assert width[j, a] == pytest.approx(math.sqrt(f @ A_inv @ f), rel=1e-8)


def test_logistic_ts_policy_keeps_one_chapelle_li_model_per_arm() -> None:
    rng = np.random.default_rng(10)
    d = 3
    policy = make_policy("logistic-ts", ["ngram", "draft"], dim=d, prior_var=2.0, discount=0.9)
    models = {a: LogisticThompson(d, prior_var=2.0, discount=0.9) for a in ("ngram", "draft")}
    for _ in range(4):
        X = rng.normal(size=(20, d))
        arms = [("ngram", "draft")[i] for i in rng.integers(0, 2, 20)]
        y = (rng.random(20) < 0.6).astype(float)
        policy.update_batch(arms, y, X)
        for a, model in models.items():
            rows = np.array([b == a for b in arms])
            if rows.any():
                model.learn_batch(X[rows], y[rows])
    Xq = rng.normal(size=(7, d))
    expected = np.column_stack(
        [models["ngram"].predict_proba(Xq), models["draft"].predict_proba(Xq)]
    )
    np.testing.assert_allclose(policy.predict_proba(Xq), expected, rtol=1e-12)
    with pytest.raises(ValueError, match="must be 0 or 1"):
        policy.update("ngram", 0.5, Xq[0])


def test_state_of_a_trained_contextual_policy_survives_json() -> None:
    rng = np.random.default_rng(11)
    policy = make_policy("linucb-hybrid", ["a", "b"], dim=2, arm_features=[[1.0], [2.0]], seed=4)
    X, idx, r = _data(rng, 30, 2, 2)
    policy.update_batch([("a", "b")[i] for i in idx], r, X)
    clone = type(policy).from_state_dict(json.loads(json.dumps(policy.state_dict())))
    Xq = rng.normal(size=(9, 2))
    for got, want in zip(clone.predict(Xq), policy.predict(Xq), strict=True):
        np.testing.assert_array_equal(got, want)
    assert clone.pull_batch(Xq) == policy.pull_batch(Xq)
