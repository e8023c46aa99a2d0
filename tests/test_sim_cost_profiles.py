"""Cost profiles: fitting from step times, parametric profiles and their minorants."""

from __future__ import annotations

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import (
    PRESETS,
    LinearCostProfile,
    RooflineCostProfile,
    StepFeatures,
    fit_linear_profile,
    get_profile,
)
from adaptive_spec.sim.strategies import cost_profiles
from hypothesis import given, settings
from hypothesis import strategies as st


def _features(rng: np.random.Generator, n: int, coef: np.ndarray, noise: float) -> StepFeatures:
    B = rng.integers(1, 9, size=n).astype(float)
    V = (B * rng.integers(0, 9, size=n)).astype(float)
    D = np.where(rng.random(n) < 0.3, rng.integers(1, 9, size=n), 0).astype(float)
    P = np.where(rng.random(n) < 0.1, rng.integers(10, 400, size=n), 0).astype(float)
    X = np.column_stack([np.ones(n), B, V, D, P])
    t = X @ coef * np.exp(rng.normal(0, noise, size=n))
    return StepFeatures(B, V, D, P, t)


def test_fit_recovers_coefficients_despite_stalls() -> None:
    rng = np.random.default_rng(0)
    coef = np.array([0.028, 0.0015, 0.0004, 0.005, 0.00005])
    f = _features(rng, 2000, coef, 0.02)
    stalls = rng.choice(2000, size=20, replace=False)
    f.step_time_s[stalls] += 1.0  # the shared machine's stalls
    prof = fit_linear_profile(f)
    got = np.array([prof.c0, prof.c_batch, prof.c_token, prof.c_draft_pass, prof.c_prefill_token])
    np.testing.assert_allclose(got, coef, rtol=0.08, atol=2e-5)
    assert prof.fit["n_outliers"] >= 20 and prof.fit["r2"] > 0.9
    assert prof.fit["unidentified"] == []


def test_fit_marks_unidentified_columns() -> None:
    rng = np.random.default_rng(1)
    f = _features(rng, 300, np.array([0.03, 0.002, 0.0005, 0.0, 0.0]), 0.01)
    f.draft_passes[:] = 0
    f.prefill_tokens[:] = 0
    prof = fit_linear_profile(f)
    assert set(prof.fit["unidentified"]) == {"c_draft_pass", "c_prefill_token"}
    assert prof.c_draft_pass == 0 and prof.c_prefill_token == 0


def test_fit_needs_steps() -> None:
    f = StepFeatures(*(np.ones(3) for _ in range(5)))
    with pytest.raises(ValueError, match="need >= 5"):
        fit_linear_profile(f)


def test_roofline_is_flat_then_linear() -> None:
    p = RooflineCostProfile(base_s=0.02, flat_tokens=32, per_token_s=0.001, draft_ratio=0.05)
    assert p.step_time(4, 0) == p.step_time(4, 28) == pytest.approx(0.02)
    assert p.step_time(4, 38) == pytest.approx(0.02 + 10 * 0.001)
    assert p.step_time(1, 4, draft_passes=4) == pytest.approx(0.02 + 4 * 0.05 * 0.02)
    np.testing.assert_allclose(
        p.step_time(np.array([1, 1]), np.array([0, 100])), [0.02, 0.02 + 69 * 0.001]
    )


@settings(max_examples=60, deadline=None)
@given(
    prof=cost_profiles(),
    B=st.integers(1, 64),
    V=st.integers(0, 512),
    D=st.integers(0, 16),
    P=st.integers(0, 2048),
)
def test_minorants_lie_below(prof, B: int, V: int, D: int, P: int) -> None:
    t = prof.step_time(B, V, D, P)
    for m in prof.minorants():
        lin = m.c0 + m.c_batch * B + m.c_token * V + m.c_draft_pass * D + m.c_prefill_token * P
        assert lin <= t * (1 + 1e-9) + 1e-15
        assert min(m.as_array()) >= 0


def test_presets_and_parsing() -> None:
    for name, prof in PRESETS.items():
        assert prof.source, name
        assert prof.step_time(64, 512) > prof.step_time(4, 16) >= prof.step_time(4, 0) > 0, name
    assert get_profile("cpu-smollm2") is PRESETS["cpu-smollm2"]
    lp = get_profile("linear:0.01,0.001,0.0005")
    assert isinstance(lp, LinearCostProfile) and lp.step_time(2, 4) == pytest.approx(0.014)
    rp = get_profile("roofline:0.02,64,0.0001,0.1")
    assert isinstance(rp, RooflineCostProfile) and rp.draft_ratio == 0.1
    for bad in ("fast", "linear:1", "linear:a,b,c", "roofline:0.02"):
        with pytest.raises(ValueError, match="not known"):
            get_profile(bad)
    with pytest.raises(ValueError, match="needs a trace"):
        get_profile("fit")


def test_invalid_profiles_refused() -> None:
    with pytest.raises(ValueError, match="c_token"):
        LinearCostProfile(0.01, 0.0, -1.0)
    with pytest.raises(ValueError, match="cannot be free"):
        LinearCostProfile(0.0)
    with pytest.raises(ValueError, match="flat_tokens"):
        RooflineCostProfile(0.02, 0.5, 0.001)
    with pytest.raises(ValueError, match=">= 0"):
        PRESETS["cpu-smollm2"].step_time(-1, 0)


def test_tabulated_h200_profile() -> None:
    from adaptive_spec.sim.cost_profiles import H200_LLAMA8B_MS, TabulatedCostProfile

    p = PRESETS["h200-llama8b"]
    assert isinstance(p, TabulatedCostProfile)
    for i, B in enumerate(p.batch_sizes):
        for j, T in enumerate(p.tokens_per_request):
            assert p.step_time(B, B * (T - 1)) == pytest.approx(H200_LLAMA8B_MS[i][j] / 1e3)
    # More verified tokens never cost less, at any batch size; past the grid it extrapolates upward.
    for B in (1, 3, 16, 50, 64, 100):
        t = p.step_time(np.full(40, B), np.arange(40) * B)
        assert (np.diff(t) >= -1e-12).all() and t[-1] > t[0]
    assert p.step_time(4, 0, draft_passes=3) == pytest.approx(p.step_time(4, 0) + 3 * 0.001333)
    with pytest.raises(ValueError, match="tokens_per_request"):
        TabulatedCostProfile((1, 2), (2, 3), ((1.0, 1.0), (1.0, 1.0)), (0.0, 0.0))
    with pytest.raises(ValueError, match="step_s"):
        TabulatedCostProfile((1, 2), (1, 3), ((1.0, -1.0), (1.0, 1.0)), (0.0, 0.0))
