"""Regret properties: stochastic bounds, adversarial no-regret, linear problems, recovery.

Hypothesis draws the problems; every assertion compares with a bound stated in the paper the
policy comes from (or a stated multiple of it), so a broken policy fails.
"""

from __future__ import annotations

import math

import numpy as np
from adaptive_spec.bandits import make_policy
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

FAST = settings(
    max_examples=6, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate)
)
NO_SHRINK = settings(
    max_examples=3, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate)
)


@st.composite
def bernoulli_problems(draw: st.DrawFn) -> np.ndarray:
    """Arm means in [0, 1] with one best arm and every gap >= 0.1."""
    k = draw(st.integers(2, 5))
    best = draw(st.floats(0.35, 0.95))
    gaps = [draw(st.floats(0.1, best)) for _ in range(k - 1)]
    means = np.array([best, *(best - g for g in gaps)])
    perm = draw(st.permutations(list(range(k))))
    return means[list(perm)]


def ucb1_bound(means: np.ndarray, horizon: int) -> float:
    """Auer et al. (2002), Theorem 1: sum_i 8 ln T / gap_i + (1 + pi^2 / 3) sum_i gap_i."""
    gaps = means.max() - means
    gaps = gaps[gaps > 0]
    return float(np.sum(8.0 * math.log(horizon) / gaps) + (1 + math.pi**2 / 3) * np.sum(gaps))


def run_stochastic(name: str, means: np.ndarray, horizon: int, seed: int) -> np.ndarray:
    """Cumulative pseudo-regret after each round of one run, shape [horizon]."""
    k = means.shape[0]
    policy = make_policy(name, list(range(k)), seed=seed)
    rng = np.random.default_rng(seed + 1000)
    gaps = means.max() - means
    regret = np.empty(horizon)
    total = 0.0
    for t in range(horizon):
        arm = policy.pull()
        policy.update(arm, float(rng.random() < means[arm]))
        total += gaps[arm]
        regret[t] = total
    return regret


@FAST
@given(means=bernoulli_problems(), seed=st.integers(0, 2**16))
def test_ucb_and_thompson_regret_is_sublinear_and_below_the_ucb1_bound(
    means: np.ndarray, seed: int
) -> None:
    t1, t2 = 300, 3000
    for name in ("ucb1", "kl-ucb", "thompson-beta"):
        regret = run_stochastic(name, means, t2, seed)
        assert regret[t2 - 1] / t2 < regret[t1 - 1] / t1, name
        assert regret[t2 - 1] <= 1.0 * ucb1_bound(means, t2), name


def test_kl_ucb_and_thompson_beat_ucb1_on_average() -> None:
    """Known ordering on Bernoulli arms (Garivier & Cappé 2011; Chapelle & Li 2011)."""
    means = np.array([0.5, 0.45, 0.4, 0.3])
    final = {
        name: np.mean([run_stochastic(name, means, 2000, s)[-1] for s in range(3)])
        for name in ("ucb1", "kl-ucb", "thompson-beta")
    }
    assert final["kl-ucb"] < final["ucb1"]
    assert final["thompson-beta"] < final["ucb1"]


@st.composite
def adversarial_rewards(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """An oblivious reward table [T, K] whose best arm changes between blocks."""
    k = draw(st.integers(2, 4))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["blocks", "alternating", "bernoulli"]))
    horizon = 3000
    if kind == "blocks":
        bounds = np.sort(rng.choice(np.arange(100, horizon), size=5, replace=False))
        rewards = np.zeros((horizon, k))
        for seg in np.split(np.arange(horizon), bounds):
            rewards[seg] = rng.random(k)
    elif kind == "alternating":  # the leader flips every round: defeats follow-the-leader
        rewards = np.zeros((horizon, k))
        rewards[0::2, 0] = 1.0
        rewards[1::2, 1] = 1.0
        rewards[:, 1] *= 0.9
    else:
        rewards = (rng.random((horizon, k)) < rng.random(k)).astype(float)
    return rewards, seed


@FAST
@given(problem=adversarial_rewards())
def test_exp3_stays_below_its_adversarial_regret_bound(problem: tuple[np.ndarray, int]) -> None:
    """Auer et al. (2002), Corollary 3.2: regret <= 2 sqrt(e - 1) sqrt(T K ln K)."""
    rewards, seed = problem
    for horizon in (500, rewards.shape[0]):
        k = rewards.shape[1]
        policy = make_policy("exp3", list(range(k)), horizon=horizon, seed=seed)
        expected = 0.0
        for t in range(horizon):
            p = policy.probabilities()
            expected += float(p @ rewards[t])
            arm = policy.pull()
            policy.update(arm, float(rewards[t, arm]))
        regret = rewards[:horizon].sum(axis=0).max() - expected
        bound = 2 * math.sqrt(math.e - 1) * math.sqrt(horizon * k * math.log(k))
        assert regret <= bound
        assert regret / horizon <= bound / horizon  # per-round regret vanishes as T grows


@FAST
@given(problem=adversarial_rewards())
def test_hedge_meets_its_anytime_bound_on_every_prefix(problem: tuple[np.ndarray, int]) -> None:
    """Cesa-Bianchi & Lugosi (2006), Theorem 2.3: regret <= 2 sqrt(T ln K / 2) + sqrt(ln K / 8)."""
    rewards, seed = problem
    horizon, k = rewards.shape
    policy = make_policy("hedge", list(range(k)), seed=seed)
    gained = np.empty(horizon)
    for t in range(horizon):
        gained[t] = policy.probabilities() @ rewards[t]
        policy.update_full(rewards[t])
    cum_best = np.cumsum(rewards, axis=0).max(axis=1)
    regret = cum_best - np.cumsum(gained)
    ts = np.arange(1, horizon + 1)
    bound = 2 * np.sqrt(ts * math.log(k) / 2) + math.sqrt(math.log(k) / 8)
    assert np.all(regret <= bound + 1e-9)
    # The same bound with a horizon-tuned learning rate is sqrt(T ln K / 2).
    tuned = make_policy("hedge", list(range(k)), horizon=horizon, seed=seed)
    got = 0.0
    for t in range(horizon):
        got += tuned.probabilities() @ rewards[t]
        tuned.update_full(rewards[t])
    assert cum_best[-1] - got <= math.sqrt(horizon * math.log(k) / 2) + 1e-9


@FAST
@given(
    seed=st.integers(0, 2**16),
    dim=st.integers(3, 6),
    k=st.integers(2, 5),
    name=st.sampled_from(["linucb", "linucb-hybrid"]),
)
def test_linear_policies_find_the_best_arm_per_context(
    seed: int, dim: int, k: int, name: str
) -> None:
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(k, dim))
    policy = make_policy(name, list(range(k)), dim=dim, seed=seed, alpha=0.5)

    def contexts(n: int) -> np.ndarray:
        return np.column_stack([np.ones(n), rng.normal(size=(n, dim - 1))])

    per_batch_regret = []
    for _ in range(100):
        X = contexts(16)
        idx = policy.pull_batch_indices(X)
        values = X @ theta.T
        rewards = values[np.arange(16), idx] + 0.1 * rng.normal(size=16)
        policy.update_batch(idx.tolist(), rewards, X)
        per_batch_regret.append(float(np.mean(values.max(axis=1) - values[np.arange(16), idx])))
    assert np.mean(per_batch_regret[-25:]) < 0.5 * np.mean(per_batch_regret[:10])
    X = contexts(500)
    values = X @ theta.T
    chosen = policy.pull_batch_indices(X)
    best = values.argmax(axis=1)
    margin = np.sort(values, axis=1)[:, -1] - np.sort(values, axis=1)[:, -2]
    clear = margin > 0.2  # near-ties are not distinguishable from noisy data
    assert np.mean(chosen[clear] == best[clear]) >= 0.9


@FAST
@given(seed=st.integers(0, 2**16), dim=st.integers(2, 5))
def test_logistic_thompson_policy_finds_the_best_arm_per_context(seed: int, dim: int) -> None:
    rng = np.random.default_rng(seed)
    k = 3
    w = rng.normal(scale=2.0, size=(k, dim))
    policy = make_policy("logistic-ts", list(range(k)), dim=dim, seed=seed)
    for _ in range(150):
        X = np.column_stack([np.ones(32), rng.normal(size=(32, dim - 1))])
        idx = policy.pull_batch_indices(X)
        p = 1 / (1 + np.exp(-(X @ w.T)[np.arange(32), idx]))
        policy.update_batch(idx.tolist(), (rng.random(32) < p).astype(float), X)
    X = np.column_stack([np.ones(400), rng.normal(size=(400, dim - 1))])
    logits = X @ w.T
    s = np.sort(logits, axis=1)
    clear = (s[:, -1] - s[:, -2] > 1.0) & (s[:, -1] > -2.0)
    best = logits.argmax(axis=1)
    greedy = policy.predict_proba(X).argmax(axis=1)
    assert np.mean(greedy[clear] == best[clear]) >= 0.9
    chosen = policy.pull_batch_indices(X)  # Thompson draws still explore the uncertain arms
    assert np.mean(chosen[clear] == best[clear]) >= 0.75


def best_arm_share(name: str, seed: int, change_at: int = 1500, **kwargs: float) -> tuple:
    """Share of pulls on the best arm before an abrupt change and 300-800 rounds after it.

    Arm means go from (0.8, 0.5, 0.2) to (0.2, 0.5, 0.8) at ``change_at``; returns the share of
    arm 0 over the 500 rounds before the change and of arm 2 over rounds
    ``change_at + 300 .. change_at + 800``.
    """
    before, after = np.array([0.8, 0.5, 0.2]), np.array([0.2, 0.5, 0.8])
    policy = make_policy(name, [0, 1, 2], seed=seed, **kwargs)
    rng = np.random.default_rng(seed)
    pulls = np.empty(change_at + 800, dtype=np.int64)
    for t in range(pulls.shape[0]):
        means = before if t < change_at else after
        arm = policy.pull()
        policy.update(arm, float(rng.random() < means[arm]))
        pulls[t] = arm
    pre = float(np.mean(pulls[change_at - 500 : change_at] == 0))
    post = float(np.mean(pulls[change_at + 300 :] == 2))
    return pre, post


NONSTATIONARY = [
    ("sw-ucb", {"window": 200}),
    ("discounted-thompson", {"gamma": 0.99}),
]


@NO_SHRINK
@given(seed=st.integers(0, 2**16))
def test_windowed_and_discounted_policies_recover_after_an_abrupt_change(seed: int) -> None:
    """Within 300 rounds of the change (window 200; memory 1 / (1 - gamma) = 100-200 rounds)
    each policy is back to its pre-change share of best-arm pulls (less 0.1), and above 0.55."""
    for name, kwargs in NONSTATIONARY:
        pre, post = best_arm_share(name, seed, **kwargs)
        assert post >= pre - 0.1 and post >= 0.55, (name, pre, post)


def test_stationary_thompson_is_slow_to_recover_where_discounted_is_not() -> None:
    shares = [best_arm_share("thompson-beta", s) for s in range(6)]
    discounted = [best_arm_share("discounted-thompson", s, gamma=0.99) for s in range(6)]
    assert np.mean([post for _, post in shares]) < 0.75 * np.mean([pre for pre, _ in shares])
    assert np.mean([post for _, post in discounted]) > 0.85
