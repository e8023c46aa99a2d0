"""The measured step-cost table and its online model: monotone, robust, repairable, never absorbing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import isotonic_regression

from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.cost_table import StepCostTable, isotonic_rows, make_monotone, prior_table


def true_cost(b: float, v: np.ndarray | float) -> np.ndarray | float:
    """A CPU-like step: 20 ms + 1 ms per request, 1 ms to speculate at all, 0.35 ms per draft token."""
    v = np.asarray(v, dtype=float)
    return 0.020 + 0.001 * b + 0.001 * (v > 0) + 0.00035 * v


def measured_table(noise: float = 0.0, seed: int = 0) -> StepCostTable:
    rng = np.random.default_rng(seed)
    B, V, T = [], [], []
    for b in (1, 2, 4, 8, 16):
        for v in (0, 1, 2, 4, 8, 16, 32, 64):
            if v > 8 * b:
                continue
            for _ in range(5):
                B.append(b)
                V.append(v)
                T.append(float(true_cost(b, v)) * float(np.exp(rng.normal(0, noise))))
    return StepCostTable.from_samples(B, V, T, key={"model": "m", "dtype": "bf16"})


def test_table_reproduces_measurements_and_the_fixed_cost_of_speculating():
    tab = measured_table()
    c = tab.curve(4, 32)
    assert c[0] == pytest.approx(0.024)
    assert c[1] - c[0] == pytest.approx(0.001 + 0.00035, rel=1e-6)  # the jump at V = 1
    assert c[8] == pytest.approx(float(true_cost(4, 8)))
    assert tab.speculation_overhead(4) == pytest.approx(0.00135, rel=1e-6)
    # between measured batch sizes: linear in B; beyond the grid: the last slope
    assert tab.predict(3, 4) == pytest.approx(float(true_cost(3, 4)), rel=1e-6)
    assert tab.predict(64, 0) == pytest.approx(float(true_cost(64, 0)), rel=1e-6)
    assert tab.predict(4, 500) > tab.predict(4, 64)


def test_a_batch_beyond_the_measured_ones_keeps_the_price_of_draft_tokens():
    """Measured at batch 1, 2 and 4 only (a calibration on a 4-request engine), where the price of
    draft tokens grows from batch 2 to 4: extrapolating every column on its own slope made the jump
    to one draft token 15 ms at batch 16 (float32, 2-core Xeon) against 1.6 ms measured there. The
    no-draft step is extrapolated in B; the draft tokens keep batch 4's price."""
    ms = {  # batch: {draft tokens: ms}, the shape of that calibration
        1: {0: 34.8, 1: 36.7, 2: 36.8, 4: 38.0, 8: 44.5},
        2: {0: 39.3, 1: 39.9, 2: 42.5, 4: 46.6, 8: 50.2, 16: 61.7},
        4: {0: 41.9, 1: 45.7, 2: 46.0, 4: 50.5, 8: 55.3, 16: 66.0, 32: 85.1},
    }
    B, V, T = zip(*[(b, v, t / 1e3) for b, row in ms.items() for v, t in row.items()], strict=True)
    tab = StepCostTable.from_samples(B, V, T)
    assert tab.measured_batch_max() == 4
    four = tab.curve(4, 32)
    for b in (8, 16, 64):
        c = tab.curve(b, 32)
        assert c[0] == pytest.approx(0.0419 + (b - 4) * (0.0419 - 0.0393) / 2, rel=1e-6)
        np.testing.assert_allclose(c - c[0], four - four[0], rtol=1e-9, atol=1e-12)
    assert prior_table().measured_batch_max() == 0


@settings(max_examples=40, deadline=None)
@given(
    noise=st.floats(0.0, 0.5),
    seed=st.integers(0, 10_000),
)
def test_table_is_monotone_whatever_the_noise(noise, seed):
    tab = measured_table(noise, seed)
    assert (np.diff(tab.seconds, axis=1) >= -1e-12).all()
    assert (np.diff(tab.seconds, axis=0) >= -1e-12).all()
    for b in (1, 3, 4, 7, 16, 40):
        assert (np.diff(tab.curve(b, 100)) >= -1e-12).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.001, 1.0), min_size=6, max_size=6), st.integers(0, 1000))
def test_make_monotone_projects_any_table(vals, seed):
    rng = np.random.default_rng(seed)
    t = rng.permutation(np.array(vals * 4)).reshape(4, 6)
    m = make_monotone(t)
    assert (np.diff(m, axis=0) >= -1e-12).all() and (np.diff(m, axis=1) >= -1e-12).all()
    # a monotone table is left as it is
    assert np.allclose(make_monotone(m), m)


@pytest.mark.parametrize("seed", range(4))
def test_isotonic_rows_equal_scipy_to_the_last_bit(seed):
    # The compiled regression runs SciPy's algorithm (ties pooled): each row with a strict decrease
    # equals scipy.optimize.isotonic_regression exactly; every other row is left untouched.
    rng = np.random.default_rng(seed)
    for _ in range(300):
        m, n = int(rng.integers(1, 6)), int(rng.integers(2, 25))
        t = rng.normal(size=(m, n)).cumsum(axis=1) * rng.choice([0.01, 1.0, 3.0])
        if rng.random() < 0.4:
            t = np.round(t, 1)  # ties inside and beside the violations
        w = np.ones((m, n)) if rng.random() < 0.3 else rng.uniform(1e-3, 5.0, size=(m, n))
        rows = np.flatnonzero(rng.random(m) < 0.7).astype(np.int64)
        want = t.copy()
        for i in rows:
            if (np.diff(t[i]) < 0).any():
                want[i] = isotonic_regression(t[i], weights=w[i], increasing=True).x
        got = t.copy()
        isotonic_rows(got, w, rows)
        assert np.array_equal(got, want)


def test_refreshed_table_is_what_the_constructor_would_build():
    # The refresh builds its tables without validating them again: they must be valid tables.
    m = StepCostModel(measured_table(0.05), refresh_every=4)
    rng = np.random.default_rng(0)
    for _ in range(64):
        b, v = int(rng.choice([4, 16])), int(rng.choice([0, 3, 8, 20]))
        m.update(b, v, float(true_cost(b, v)) * float(np.exp(rng.normal(0.2, 0.2))))
    assert m.n_refreshes > 0
    t = m.table
    rebuilt = StepCostTable(
        t.batch_sizes, t.draft_tokens, t.seconds, counts=t.counts, key=t.key, source=t.source
    )
    assert np.array_equal(rebuilt.seconds, t.seconds) and np.array_equal(rebuilt.counts, t.counts)
    assert t.source.endswith("learned") and t.curve(16, 20).shape == (21,)


def test_roundtrip_and_refusals():
    tab = measured_table(0.1)
    back = StepCostTable.from_dict(json.loads(json.dumps(tab.to_dict())))
    assert np.allclose(back.seconds, tab.seconds, rtol=1e-5) and back.key == tab.key
    assert back.matches({"model": "m", "dtype": "bf16"}) and not back.matches({"model": "x"})
    with pytest.raises(ValueError, match="not an adaptive-spec cost table"):
        StepCostTable.from_dict({"format": "other"})
    bad = tab.to_dict()
    bad["seconds"][0][0] = -1.0
    with pytest.raises(ValueError, match="non-positive"):
        StepCostTable.from_dict(bad)
    with pytest.raises(ValueError, match="draft_tokens"):
        StepCostTable([1, 2], [1, 2], np.ones((2, 2)))
    with pytest.raises(ValueError, match="no valid step"):
        StepCostTable.from_samples([1], [0], [float("nan")])


def test_model_ignores_bad_times_and_prefill_steps():
    m = StepCostModel(measured_table())
    assert not m.update(4, 8, float("nan"))
    assert not m.update(4, 8, -1.0)
    assert not m.update(4, 8, float("inf"))
    assert not m.update(0, 8, 0.02)
    assert m.n_ignored == 4 and m.n_updates == 0
    before = m.table.seconds.copy()
    for _ in range(100):  # prefill steps are slow, and say nothing about verification
        assert m.update(4, 0, 0.2, prefill_tokens=2000)
    assert m.load == 1.0 and np.array_equal(m.table.seconds, before)
    assert m.prefill_s_per_token == pytest.approx((0.2 - 0.024) / 2000, rel=0.01)


def test_load_factor_tracks_a_noisy_neighbour_within_20_steps_and_ignores_stalls():
    m = StepCostModel(measured_table())
    for _ in range(20):
        m.update(4, 8, 3 * float(true_cost(4, 8)))
    assert m.load == pytest.approx(3.0, rel=0.15)
    for _ in range(30):
        m.update(4, 8, float(true_cost(4, 8)))
    assert m.load == pytest.approx(1.0, rel=0.05)
    m.update(4, 8, 1.0)  # a one-second stall moves the load factor by at most a bounded step
    assert m.load < 1.2


def test_a_wrong_table_is_repaired_where_steps_are_observed():
    """A state claiming 100 ms per draft token: observed steps at V = 0 and V = 4 correct the row."""
    bogus = StepCostTable.from_samples(
        [4] * 4, [0, 1, 8, 32], [0.024, 0.124, 0.824, 3.224], key={"model": "m"}
    )
    m = StepCostModel(bogus, refresh_every=16)
    for i in range(400):
        v = (0, 4)[i % 2]
        m.update(4, v, float(true_cost(4, v)))
    pred = m.curve(4, 8)
    assert pred[4] - pred[0] == pytest.approx(0.001 + 4 * 0.00035, abs=0.002)
    assert (np.diff(m.table.seconds, axis=1) >= -1e-12).all()


def test_prior_table_scales_to_the_first_decode_step():
    m = StepCostModel()
    assert m.table.source == "prior"
    m.update(8, 0, 0.05)
    assert m.predict(8, 0) == pytest.approx(0.05, rel=1e-6)
    assert m.predict(8, 16) > m.predict(8, 0)


def test_state_roundtrip_restarts_the_load_factor():
    m = StepCostModel(measured_table())
    for _ in range(30):
        m.update(4, 8, 2 * float(true_cost(4, 8)))
    fresh = StepCostModel()
    fresh.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert fresh.load == 1.0 and np.allclose(fresh.table.seconds, m.table.seconds, rtol=1e-5)
    with pytest.raises(ValueError, match="no table"):
        fresh.load_state_dict({})


def test_prior_table_shape():
    t = prior_table(0.02)
    assert t.speculation_overhead(1) == pytest.approx(0.02 * (0.05 + 0.015), rel=1e-6)
    assert math.isclose(float(t.predict(1, 10) - t.predict(1, 0)), 0.02 * (0.05 + 0.15))


def sampled_cost(b: float, v: np.ndarray | float) -> np.ndarray | float:
    """The same step when every request samples: verification costs 2.5 ms more per draft token."""
    v = np.asarray(v, dtype=float)
    return true_cost(b, v) + 0.0025 * v


def table_with_sampled_part() -> StepCostTable:
    greedy = measured_table()
    B, V = np.meshgrid([1, 2, 4, 8, 16], [0, 1, 2, 4, 8, 16, 32, 64], indexing="ij")
    part = StepCostTable.from_samples(B.ravel(), V.ravel(), sampled_cost(B.ravel(), V.ravel()))
    return StepCostTable(
        greedy.batch_sizes, greedy.draft_tokens, greedy.seconds, key=greedy.key, sampled=part
    )


def test_sampled_part_prices_sampled_steps_and_mixes_by_share():
    tab = table_with_sampled_part()
    assert tab.predict(4, 8) == pytest.approx(float(true_cost(4, 8)), rel=1e-6)
    assert tab.predict(4, 8, sampled=1.0) == pytest.approx(float(sampled_cost(4, 8)), rel=1e-6)
    mid = 0.5 * (float(true_cost(4, 8)) + float(sampled_cost(4, 8)))
    assert tab.predict(4, 8, sampled=0.5) == pytest.approx(mid, rel=1e-6)
    m = StepCostModel(tab)
    assert m.at(4, 8) == pytest.approx(float(true_cost(4, 8)), rel=1e-6)
    assert m.at(4, 8, 1.0) == pytest.approx(float(sampled_cost(4, 8)), rel=1e-6)
    assert m.curve(4, 8, 0.5)[8] == pytest.approx(mid, rel=1e-6)
    # without a sampled part the greedy table stands in
    assert StepCostModel(measured_table()).at(4, 8, 1.0) == pytest.approx(float(true_cost(4, 8)))


def test_sampled_part_roundtrips_and_a_bad_one_is_refused():
    tab = table_with_sampled_part()
    back = StepCostTable.from_dict(json.loads(json.dumps(tab.to_dict())))
    assert back.sampled is not None
    assert np.allclose(back.sampled.seconds, tab.sampled.seconds, rtol=1e-5)
    assert back.scaled(2.0).predict(4, 8, sampled=1) == pytest.approx(
        2 * float(sampled_cost(4, 8)), rel=1e-5
    )
    bad = tab.to_dict()
    bad["sampled"]["seconds"] = bad["sampled"]["seconds"][:-1]  # another grid
    with pytest.raises(ValueError, match="shape"):
        StepCostTable.from_dict(bad)
    bad["sampled"] = [1, 2]
    with pytest.raises(ValueError, match="malformed"):
        StepCostTable.from_dict(bad)
    other = StepCostTable.from_samples(
        [1, 2], [0, 1], [0.01, 0.02], batch_grid=[1, 2], token_grid=[0, 1]
    )
    with pytest.raises(ValueError, match="same batch_sizes"):
        StepCostTable(tab.batch_sizes, tab.draft_tokens, tab.seconds, sampled=other)


def test_sampled_steps_learn_against_the_sampled_part_and_keep_it():
    """Sampled steps measured as the sampled part predicts move neither the load factor nor the shape;
    a refresh keeps the sampled part (corrected alike) and its state round-trips."""
    m = StepCostModel(table_with_sampled_part(), refresh_every=8)
    for i in range(64):
        v = (0, 4, 8)[i % 3]
        m.update(4, v, float(sampled_cost(4, v)), sampled=1.0)
    assert m.load == pytest.approx(1.0, abs=1e-6)
    assert m.n_refreshes > 0 and m.table.sampled is not None
    assert m.at(4, 8, 1.0) == pytest.approx(float(sampled_cost(4, 8)), rel=1e-3)
    assert m.at(4, 8) == pytest.approx(float(true_cost(4, 8)), rel=1e-3)
    fresh = StepCostModel()
    fresh.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert fresh.at(4, 8, 1.0) == pytest.approx(m.at(4, 8, 1.0), rel=1e-5)
