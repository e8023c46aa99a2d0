"""Synthetic workloads: acceptance processes, computable optima, generators."""

from __future__ import annotations

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.strategies import acceptance_processes, workloads
from adaptive_spec.sim.synthetic import (
    CHAT,
    CODE,
    TRAP,
    WORKLOAD_NAMES,
    AcceptanceProcess,
    Regime,
    RequestSpec,
    best_static_arm,
    make_requests,
    named_workload,
    optimal_rate,
    pseudo_regret,
    ramp_arrivals,
    static_arm_rate,
    stationary,
)
from hypothesis import given, settings

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.baselines import StaticPolicy

PROF = PRESETS["cpu-smollm2"]


@settings(max_examples=50, deadline=None)
@given(proc=acceptance_processes())
def test_pmf_and_expected_accepted(proc: AcceptanceProcess) -> None:
    K = 6
    pmf = proc.pmf(K)
    assert pmf.shape == (K + 1,) and pmf.min() >= 0 and pmf.sum() == pytest.approx(1.0)
    for k in range(K + 1):
        direct = sum(min(k, j) * pmf[j] for j in range(K + 1))
        assert proc.expected_accepted(k, K) == pytest.approx(direct)


def test_sampling_matches_pmf() -> None:
    rng = np.random.default_rng(0)
    proc = AcceptanceProcess(0.6, offer=0.7)
    draws = [proc.sample(rng, 5) for _ in range(20_000)]
    offered = [d for d in draws if d is not None]
    assert len(offered) / len(draws) == pytest.approx(0.7, abs=0.015)
    hist = np.bincount(offered, minlength=6) / len(offered)
    np.testing.assert_allclose(hist, proc.pmf(5), atol=0.015)


@settings(max_examples=25, deadline=None)
@given(wl=workloads())
def test_generated_drafts_have_the_sampled_acceptance(wl) -> None:
    reqs, k = wl
    for r in reqs:
        for p, table in r.drafts.items():
            assert len(table) == len(r)
            for n, d in enumerate(table):
                assert d is not None and d.size in (0, k)
                m = r.match_length(p, n)
                assert 0 <= m <= min(d.size, len(r) - n)
                np.testing.assert_array_equal(d[:m], r.output_token_ids[n : n + m])
                if m < d.size and n + m < len(r):
                    assert d[m] != r.output_token_ids[n + m]


def test_static_rate_matches_long_replay() -> None:
    """The computable long-run goodput of a static arm equals what the simulator measures."""
    reqs = make_requests(stationary(CODE, 12, 400), 8, seed=4)
    for arm, B in ((Arm("ngram", 6), 1), (Arm("jacobi", 2), 4), (Arm("none", 0), 4)):
        res = replay(reqs, StaticPolicy(["ngram", "jacobi"], 8, arm), PROF, max_batch=B)
        assert res.goodput == pytest.approx(static_arm_rate(CODE, arm, PROF, 8, B), rel=0.04), (
            arm,
            B,
        )


def test_optimum_dominates_static_and_regret_is_zero_at_the_optimum() -> None:
    for reg in (CODE, CHAT, TRAP):
        _, rate = best_static_arm(reg, PROF, 8, ["ngram", "jacobi"])
        G = optimal_rate(reg, PROF, 8, ["ngram", "jacobi"])
        assert rate * (1 - 1e-9) <= G
        # Regret is >= 0 for every arm and 0 for the best one in each offer state.
        for offered in ({"ngram", "jacobi"}, {"jacobi"}, set()):
            regs = [
                pseudo_regret(reg, offered, Arm(p, k), G, PROF, 8)
                for p in ("ngram", "jacobi")
                for k in range(1, 9)
            ]
            regs.append(pseudo_regret(reg, offered, Arm("none", 0), G, PROF, 8))
            assert min(regs) == pytest.approx(0.0, abs=1e-9) and min(regs) >= 0
    assert best_static_arm(CODE, PROF, 8, ["ngram", "jacobi"])[0].proposer == "ngram"
    assert best_static_arm(CHAT, PROF, 8, ["ngram", "jacobi"])[0].proposer == "jacobi"


def test_regime_boundaries_and_named_workloads() -> None:
    spec = RequestSpec(10, ((0, CODE), (4, CHAT)))
    assert [spec.regime_at(n).name for n in (0, 3, 4, 9)] == ["code", "code", "chat", "chat"]
    for name in WORKLOAD_NAMES:
        wl = named_workload(name)
        reqs = make_requests(wl.specs, 4, seed=1)
        assert len(reqs) == len(wl.specs) > 0
    arr = ramp_arrivals(200, 1.0, 50.0, seed=0)
    gaps = np.diff(arr)
    assert (gaps >= 0).all() and gaps[:50].mean() > 3 * gaps[-50:].mean()
    with pytest.raises(ValueError, match="not known"):
        named_workload("nope")
    with pytest.raises(ValueError, match="alpha"):
        AcceptanceProcess(1.5)
    with pytest.raises(ValueError, match="start at position 0"):
        RequestSpec(5, ((1, CODE),))
    with pytest.raises(ValueError, match="'none'"):
        Regime("x", {"none": AcceptanceProcess(0.5)})
