"""Tests for :class:`adaptive_spec.bandits.LogisticThompson` (Chapelle & Li 2011, Algorithm 3)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from adaptive_spec.bandits import LogisticThompson
from scipy.optimize import minimize
from scipy.special import expit


def _logistic_data(
    rng: np.random.Generator, w: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    X = np.column_stack([np.ones(n), rng.normal(size=(n, w.shape[0] - 1))])
    y = (rng.random(n) < expit(X @ w)).astype(float)
    return X, y


def test_one_batch_matches_direct_minimisation_and_laplace_precision() -> None:
    """The mean is the exact MAP of Algorithm 3's objective; precision adds the Hessian diagonal."""
    rng = np.random.default_rng(3)
    dim = 5
    model = LogisticThompson(dim, prior_var=2.0, seed=0)
    # A first batch so that the prior of the second is not isotropic.
    X0, y0 = _logistic_data(rng, rng.normal(size=dim), 40)
    model.learn_batch(X0, y0)
    m, q = model.mean, 1.0 / model.variance
    X, y = _logistic_data(rng, rng.normal(size=dim), 64)
    s = rng.uniform(0.2, 3.0, size=64)

    def f(w: np.ndarray) -> float:
        z = X @ w
        return 0.5 * np.sum(q * (w - m) ** 2) + np.sum(s * (np.logaddexp(0, z) - y * z))

    def g(w: np.ndarray) -> np.ndarray:
        return q * (w - m) + X.T @ (s * (expit(X @ w) - y))

    ref = minimize(f, m, jac=g, method="BFGS", options={"gtol": 1e-10})
    model.learn_batch(X, y, sample_weight=s)
    np.testing.assert_allclose(model.mean, ref.x, atol=1e-6)
    p = expit(X @ model.mean)
    expected_prec = q + (X**2).T @ (s * p * (1 - p))
    np.testing.assert_allclose(1.0 / model.variance, expected_prec, rtol=1e-10)
    assert model.n_updates == 40 + 64


def test_recovers_true_weights_and_is_calibrated() -> None:
    rng = np.random.default_rng(0)
    dim = 8
    w_true = rng.normal(scale=1.0, size=dim)
    model = LogisticThompson(dim, seed=1)
    for _ in range(150):
        model.learn_batch(*_logistic_data(rng, w_true, 64))
    assert np.max(np.abs(model.mean - w_true)) < 0.25
    X, _ = _logistic_data(rng, w_true, 2000)
    assert np.max(np.abs(model.predict_proba(X) - expit(X @ w_true))) < 0.08
    assert model.n_updates == 150 * 64


def test_prediction_moderation_sampling_and_ucb_are_consistent() -> None:
    rng = np.random.default_rng(5)
    dim = 4
    model = LogisticThompson(dim, prior_var=3.0, seed=2)
    model.learn_batch(*_logistic_data(rng, np.array([1.5, -1.0, 0.5, 2.0]), 20))
    X = rng.normal(size=(6, dim)) * 2.0
    mu = X @ model.mean
    var = (X**2) @ model.variance
    p = model.predict_proba(X)
    # Moderated: same side of 1/2 as the mean logit, but closer to 1/2 than sigmoid(mu).
    assert np.all(np.sign(p - 0.5) == np.sign(mu))
    assert np.all(np.abs(p - 0.5) < np.abs(expit(mu) - 0.5))
    # UCB: alpha = 0 is the plug-in estimate; increasing in alpha.
    np.testing.assert_allclose(model.ucb_proba(X, alpha=0.0), expit(mu), rtol=1e-12)
    u1, u2 = model.ucb_proba(X, alpha=1.0), model.ucb_proba(X, alpha=2.0)
    np.testing.assert_allclose(u1, expit(mu + np.sqrt(var)), rtol=1e-12)
    assert np.all(u2 > u1) and np.all(u1 > expit(mu))
    # Thompson draws: the sampled logits have the posterior's mean and variance.
    draws = np.array([model.sample_proba(X) for _ in range(20000)])
    logits = np.log(draws) - np.log1p(-draws)
    assert np.all(np.abs(logits.mean(axis=0) - mu) < 5 * np.sqrt(var / 20000))
    np.testing.assert_allclose(logits.var(axis=0), var, rtol=0.05)
    # Monte-Carlo predictive mean agrees with the probit approximation to within ~0.02.
    np.testing.assert_allclose(draws.mean(axis=0), p, atol=0.02)


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    X = np.random.default_rng(0).normal(size=(64, 16))
    a, b, c = (LogisticThompson(16, seed=s) for s in (7, 7, 8))
    np.testing.assert_array_equal(a.sample_proba(X), b.sample_proba(X))
    assert not np.array_equal(a.sample_proba(X), c.sample_proba(X))


def test_sample_weight_two_equals_duplicated_rows_and_zero_equals_dropping() -> None:
    rng = np.random.default_rng(11)
    X, y = _logistic_data(rng, np.array([0.3, 1.0, -2.0]), 30)
    dup = LogisticThompson(3)
    dup.learn_batch(np.vstack([X, X[:10]]), np.concatenate([y, y[:10]]))
    weighted = LogisticThompson(3)
    w = np.ones(30)
    w[:10] = 2.0
    weighted.learn_batch(X, y, sample_weight=w)
    np.testing.assert_allclose(weighted.mean, dup.mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(weighted.variance, dup.variance, rtol=1e-9)
    dropped = LogisticThompson(3)
    dropped.learn_batch(X[10:], y[10:])
    zeroed = LogisticThompson(3)
    w0 = np.ones(30)
    w0[:10] = 0.0
    zeroed.learn_batch(X, y, sample_weight=w0)
    np.testing.assert_allclose(zeroed.mean, dropped.mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(zeroed.variance, dropped.variance, rtol=1e-9)


def test_discount_bounds_precision_and_tracks_an_abrupt_change() -> None:
    rng = np.random.default_rng(2)
    dim = 3
    before, after = np.array([2.0, 1.0, -1.0]), np.array([-2.0, -1.0, 1.0])
    stationary = LogisticThompson(dim, seed=0)
    forgetful = LogisticThompson(dim, discount=0.8, seed=0)
    for _ in range(200):
        batch = _logistic_data(rng, before, 32)
        stationary.learn_batch(*batch)
        forgetful.learn_batch(*batch)
    # Precision grows without bound when stationary; geometric forgetting caps it.
    assert np.min(1 / stationary.variance) > 10 * np.max(1 / forgetful.variance)
    for _ in range(15):
        batch = _logistic_data(rng, after, 32)
        stationary.learn_batch(*batch)
        forgetful.learn_batch(*batch)
    assert np.max(np.abs(forgetful.mean - after)) < 0.8
    assert np.linalg.norm(stationary.mean - after) > 2 * np.linalg.norm(forgetful.mean - after)


def test_discount_shrinks_precision_toward_prior_before_the_batch() -> None:
    model = LogisticThompson(2, prior_var=0.5, discount=0.5)
    X = np.array([[1.0, 0.0]])
    model.learn_batch(X, [1])
    q1 = 1 / model.variance
    model.learn_batch(np.array([[0.0, 1.0]]), [0])
    q2 = 1 / model.variance
    # Feature 0 saw no data in the second batch: only forgetting toward q0 = 2 applies.
    assert q2[0] == pytest.approx(2.0 + 0.5 * (q1[0] - 2.0), rel=1e-12)


def test_separable_large_features_stay_finite() -> None:
    model = LogisticThompson(2, prior_var=1.0, seed=0)
    X = np.array([[1.0, 1e3], [1.0, -1e3]] * 32)
    y = np.array([1, 0] * 32)
    for _ in range(20):
        model.learn_batch(X, y)
    assert np.isfinite(model.mean).all() and np.isfinite(model.variance).all()
    assert np.all(model.variance > 0)
    plug_in = model.ucb_proba(X[:2], alpha=0.0)
    assert plug_in[0] > 0.99 and plug_in[1] < 0.01
    p = model.predict_proba(X[:2])
    assert p[0] > 0.5 > p[1]
    for q in (model.sample_proba(X[:2]), model.ucb_proba(X[:2], alpha=3.0)):
        assert np.isfinite(q).all() and np.all((q >= 0) & (q <= 1))


def test_empty_batch_is_a_no_op() -> None:
    model = LogisticThompson(3, discount=0.5)
    model.learn_batch(np.ones((4, 3)), [1, 1, 0, 1])
    before = model.state_dict()
    model.learn_batch(np.zeros((0, 3)), np.zeros(0))
    assert model.state_dict() == before
    assert model.predict_proba(np.zeros((0, 3))).shape == (0,)


def test_state_dict_round_trips_through_json_bit_for_bit() -> None:
    rng = np.random.default_rng(4)
    model = LogisticThompson(16, prior_var=0.7, discount=0.95, seed=123)
    for _ in range(5):
        model.learn_batch(*_logistic_data(rng, rng.normal(size=16), 64))
    model.sample_proba(np.ones((3, 16)))  # advance the generator
    state = json.loads(json.dumps(model.state_dict()))
    clone = LogisticThompson(2)  # different dim: load takes everything from the state
    clone.load_state_dict(state)
    assert clone.state_dict() == model.state_dict()
    X, y = _logistic_data(rng, rng.normal(size=16), 64)
    np.testing.assert_array_equal(clone.sample_proba(X), model.sample_proba(X))
    np.testing.assert_array_equal(clone.predict_proba(X), model.predict_proba(X))
    clone.learn_batch(X, y)
    model.learn_batch(X, y)
    np.testing.assert_array_equal(clone.mean, model.mean)
    np.testing.assert_array_equal(clone.variance, model.variance)
    assert clone.n_updates == model.n_updates
    assert repr(clone) == repr(model)


@pytest.mark.parametrize(
    ("state_patch", "match"),
    [
        ({"class": "Other"}, "expected 'LogisticThompson'"),
        ({"mean": [0.0]}, "must have 16 entries"),
        ({"precision": [0.0] * 16}, "precision"),
        ({"mean": [float("nan")] * 16}, "finite"),
        ({"n_updates": -1}, "n_updates"),
        ({"rng": {"bit_generator": "Nope"}}, "unknown bit generator"),
    ],
)
def test_load_state_dict_rejects_bad_states_and_keeps_the_model(
    state_patch: dict, match: str
) -> None:
    model = LogisticThompson(16, seed=0)
    good = model.state_dict()
    with pytest.raises(ValueError, match=match):
        model.load_state_dict({**good, **state_patch})
    assert model.state_dict() == good
    with pytest.raises(ValueError, match="missing key"):
        model.load_state_dict({k: v for k, v in good.items() if k != "rng"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "dim"),
        ({"dim": 2.5}, "dim"),
        ({"dim": 3, "prior_var": 0.0}, "prior_var"),
        ({"dim": 3, "prior_var": float("inf")}, "prior_var"),
        ({"dim": 3, "discount": 0.0}, "discount"),
        ({"dim": 3, "discount": 1.5}, "discount"),
        ({"dim": 3, "seed": -1}, "seed"),
    ],
)
def test_constructor_rejects_bad_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LogisticThompson(**kwargs)


def test_bad_inputs_raise_value_errors_naming_the_parameter_and_change_nothing() -> None:
    model = LogisticThompson(3, seed=0)
    X = np.ones((2, 3))
    model.learn_batch(X, [1, 0])
    good = model.state_dict()
    bad_calls = [
        (lambda: model.learn_batch(np.array([[1.0, np.nan, 0.0], [1, 1, 1]]), [1, 0]), "X"),
        (lambda: model.learn_batch(np.array([[1.0, np.inf, 0.0], [1, 1, 1]]), [1, 0]), "X"),
        (lambda: model.learn_batch(np.ones((2, 4)), [1, 0]), r"X must have shape \[n, 3\]"),
        (lambda: model.learn_batch(np.ones(3), [1]), "X must have shape"),
        (lambda: model.learn_batch(X, [1, 0, 1]), r"y must have shape \[2\]"),
        (lambda: model.learn_batch(X, [1, 0.5]), "y must hold only 0 or 1"),
        (lambda: model.learn_batch(X, [1, 2]), "y must hold only 0 or 1"),
        (lambda: model.learn_batch(X, [1, np.nan]), "y must be finite"),
        (lambda: model.learn_batch(X, [1, 0], sample_weight=[1.0, -1.0]), "sample_weight"),
        (lambda: model.learn_batch(X, [1, 0], sample_weight=[1.0, np.inf]), "sample_weight"),
        (lambda: model.learn_batch(X, [1, 0], sample_weight=[1.0]), "sample_weight"),
        (lambda: model.learn_batch([["a", "b", "c"]] * 2, [1, 0]), "X must be numeric"),
        (lambda: model.predict_proba(np.full((1, 3), np.nan)), "X must be finite"),
        (lambda: model.sample_proba(np.ones((1, 2))), "X must have shape"),
        (lambda: model.ucb_proba(X, alpha=-1.0), "alpha"),
        (lambda: model.ucb_proba(X, alpha=np.nan), "alpha"),
    ]
    for call, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            call()
    assert model.state_dict() == good


def test_bool_and_integer_labels_are_accepted() -> None:
    a, b = LogisticThompson(2), LogisticThompson(2)
    X = np.array([[1.0, 0.5], [1.0, -0.5]])
    a.learn_batch(X, np.array([True, False]))
    b.learn_batch(X, np.array([1, 0], dtype=np.int64))
    np.testing.assert_array_equal(a.mean, b.mean)


def test_grouped_update_equals_one_update_per_model() -> None:
    from adaptive_spec.bandits.logistic_ts import laplace_update, laplace_update_grouped

    rng = np.random.default_rng(21)
    groups, dim, n = 9, 5, 300
    X = rng.normal(size=(n, dim)) * rng.uniform(0.1, 4.0, size=dim)
    group = rng.integers(0, groups, n)
    group[:20] = 3  # one group gets separable data at a large scale
    X[:20, 0] = np.linspace(-50, 50, 20)
    y = (rng.random(n) < expit(X[:, 0] - X[:, 1])).astype(float)
    y[:20] = (X[:20, 0] > 0).astype(float)
    means = rng.normal(size=(groups, dim))
    precs = rng.uniform(0.5, 5.0, size=(groups, dim))
    got_m, got_q = laplace_update_grouped(X, y, group, means, precs, 0.8, 0.9)
    for g in range(groups):
        rows = group == g
        m, q = laplace_update(X[rows], y[rows], np.ones(rows.sum()), means[g], precs[g], 0.8, 0.9)
        np.testing.assert_allclose(got_m[g], m, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got_q[g], q, rtol=1e-9)
