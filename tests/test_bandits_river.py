"""Differential tests against river's bandit policies (river 0.2x, ``river.bandit``).

Where river is right, ours agree with it on the same reward stream; where it is not (EXP3
overflow, Beta updates of fractional rewards), the test shows the difference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from adaptive_spec.bandits import make_policy

bandit = pytest.importorskip("river.bandit")
proba = pytest.importorskip("river.proba")


def test_ucb1_makes_rivers_ucb_choice_whenever_the_choice_is_unambiguous() -> None:
    """river ``UCB(delta=1)`` is UCB1 (mean + sqrt(2 ln n / n_i)); river drives, we check."""
    means = np.array([0.3, 0.5, 0.45, 0.7, 0.65])
    arms = list(range(means.shape[0]))
    river_ucb = bandit.UCB(delta=1, seed=0)
    ours = make_policy("ucb1", arms, seed=0)
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(3000):
        choice = river_ucb.pull(arms)
        scores = ours._scores(None, 1)
        top2 = np.sort(scores)[-2:]
        if np.isfinite(top2).all() and top2[1] - top2[0] > 1e-9:
            assert ours.pull() == choice
            compared += 1
        reward = float(rng.random() < means[choice])
        river_ucb.update(choice, reward)
        ours.update(choice, reward)
    assert compared > 2900
    np.testing.assert_array_equal(ours.counts, [river_ucb._counts[a] for a in arms])


def test_thompson_beta_matches_rivers_posterior_and_choice_distribution() -> None:
    """Same binary reward stream: identical Beta posteriors; pulls drawn from the same law."""
    means = np.array([0.2, 0.5, 0.55])
    arms = [0, 1, 2]
    river_ts = bandit.ThompsonSampling(reward_obj=proba.Beta(1, 1), seed=3)
    ours = make_policy("thompson-beta", arms, seed=3)
    rng = np.random.default_rng(1)
    for _ in range(300):
        arm = river_ts.pull(arms)  # river drives; both learn the same (arm, reward) stream
        reward = float(rng.random() < means[arm])
        river_ts.update(arm, reward)
        ours.update(arm, reward)
    alpha, beta = ours.posterior
    for a in arms:
        dist = river_ts._rewards[a]
        assert (dist.alpha, dist.beta) == (alpha[a], beta[a])
    # Choice frequencies from the frozen posterior agree (each within 4 standard errors).
    n = 4000
    ours_freq = np.bincount(ours.pull_batch_indices(n=n), minlength=3) / n
    river_freq = np.bincount([river_ts.pull(arms) for _ in range(n)], minlength=3) / n
    se = np.sqrt(np.maximum(ours_freq * (1 - ours_freq), 1e-4) * 2 / n)
    assert np.all(np.abs(ours_freq - river_freq) <= 4 * se)


def test_rivers_beta_counts_a_fractional_reward_as_a_full_success_ours_does_not() -> None:
    """Rewards in [0, 1] (e.g. an acceptance rate): river's Beta.update(0.3) adds a success."""
    river_ts = bandit.ThompsonSampling(reward_obj=proba.Beta(1, 1), seed=0)
    ours = make_policy("thompson-beta", [0], seed=0)
    for _ in range(1000):
        river_ts.update(0, 0.3)
        ours.update(0, 0.3)
    dist = river_ts._rewards[0]
    river_mean = dist.alpha / (dist.alpha + dist.beta)
    alpha, beta = ours.posterior
    our_mean = alpha[0] / (alpha[0] + beta[0])
    assert river_mean > 0.99  # 1000 "successes"
    assert our_mean == pytest.approx(0.3, abs=1e-3)


def test_rivers_exp3_overflows_where_ours_stays_exact() -> None:
    """river multiplies raw weights; on a stream where one arm always pays, they overflow."""
    arms = [0, 1, 2]
    gamma = 0.1
    river_exp3 = bandit.Exp3(gamma=gamma, seed=1)
    ours = make_policy("exp3", arms, gamma=gamma, seed=1)
    failed_at = None
    for t in range(200_000):
        try:
            arm = river_exp3.pull(arms)
        except (ValueError, OverflowError):
            failed_at = t
            break
        river_exp3.update(arm, 1.0 if arm == 0 else 0.0)
    assert failed_at is not None, "river's Exp3 no longer overflows: update this test"
    assert not all(math.isfinite(w) for w in river_exp3._weights.values())
    # Ours on the same kind of stream, one step at a time past river's failure point...
    for _ in range(failed_at + 1000):
        arm = ours.pull()
        ours.update(arm, 1.0 if arm == 0 else 0.0)
    p = ours.probabilities()
    assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(p, [1 - gamma + gamma / 3, gamma / 3, gamma / 3], rtol=1e-9)
    # ... and then 10^6 more updates in batches.
    for _ in range(4):
        idx = ours.pull_batch_indices(n=250_000)
        ours.update_batch(idx.tolist(), (idx == 0).astype(float))
    p = ours.probabilities()
    assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0, abs=1e-12)
    assert p[0] == pytest.approx(1 - gamma + gamma / 3, rel=1e-9)


def test_exp3_probabilities_follow_rivers_formula_while_rivers_weights_are_finite() -> None:
    """Before the overflow, river's probabilities and ours agree on the same stream."""
    arms = [0, 1, 2, 3]
    gamma = 0.3
    river_exp3 = bandit.Exp3(gamma=gamma, seed=5)
    ours = make_policy("exp3", arms, gamma=gamma, seed=5)
    rng = np.random.default_rng(2)
    means = [0.2, 0.4, 0.6, 0.3]
    for _ in range(500):
        arm = river_exp3.pull(arms)  # sets river's probabilities used by its update
        river_p = np.array([river_exp3._probabilities[a] for a in arms])
        np.testing.assert_allclose(ours.probabilities(), river_p, rtol=1e-9)
        reward = float(rng.random() < means[arm])
        river_exp3.update(arm, reward)
        ours.update(arm, reward)


def test_epsilon_greedy_exploits_the_same_arm_as_river() -> None:
    arms = [0, 1, 2]
    river_eg = bandit.EpsilonGreedy(epsilon=0.0, seed=0)
    ours = make_policy("epsilon-greedy", arms, epsilon=0.0, seed=0)
    rng = np.random.default_rng(4)
    for t in range(30):  # every arm observed, then a random stream
        arm = t if t < 3 else int(rng.integers(0, 3))
        reward = float(rng.normal([0.1, 0.9, 0.4][arm], 0.5))
        river_eg.update(arm, reward)
        ours.update(arm, reward)
        assert ours.pull() == river_eg.pull(arms) or t < 2


def test_shared_statistics_equal_rivers_per_arm_streams() -> None:
    """ArmSums (UCB family, Thompson) and WindowSums (SW-UCB) against river's scalar statistics.

    river keeps one stream per object, updated one value per call: per arm a ``stats.Mean`` and a
    ``stats.Var`` for the plain sums, and for SW-UCB's window (the last w observations of all arms
    together) a ``utils.Rolling`` sum per arm over the stream ``r * 1{arm}``."""
    from adaptive_spec.bandits.stats import ArmSums, WindowSums

    stats = pytest.importorskip("river.stats")
    utils = pytest.importorskip("river.utils")
    rng = np.random.default_rng(9)
    k, window = 3, 25
    plain = ArmSums(k, squares=True)
    windowed = WindowSums(k, window)
    means = [stats.Mean() for _ in range(k)]
    variances = [stats.Var(ddof=0) for _ in range(k)]
    rolling_sum = [utils.Rolling(stats.Sum, window_size=window) for _ in range(k)]
    rolling_count = [utils.Rolling(stats.Sum, window_size=window) for _ in range(k)]
    for n in (1, 7, 30, 2, 25, 11):
        idx = rng.integers(0, k, n)
        r = rng.random(n)
        plain.learn(idx, r)
        windowed.learn(idx, r)
        for a, x in zip(idx.tolist(), r.tolist(), strict=True):
            means[a].update(x)
            variances[a].update(x)
            for b in range(k):
                rolling_sum[b].update(x if b == a else 0.0)
                rolling_count[b].update(1.0 if b == a else 0.0)
        seen = plain.counts > 0  # river's Mean of nothing is 0, ours NaN
        river_means = np.array([m.get() for m in means])
        np.testing.assert_allclose(plain.means()[seen], river_means[seen], rtol=1e-12)
        assert np.isnan(plain.means()[~seen]).all()
        var = plain.sq_sums[seen] / plain.counts[seen] - plain.means()[seen] ** 2
        river_var = np.array([v.get() for v in variances])
        np.testing.assert_allclose(var, river_var[seen], atol=1e-12)
        np.testing.assert_array_equal(windowed.counts, [c.get() for c in rolling_count])
        np.testing.assert_allclose(windowed.sums, [s.get() for s in rolling_sum], atol=1e-12)
