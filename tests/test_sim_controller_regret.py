"""The default controller on synthetic workloads with a known optimum: sublinear regret, and quick
switching after regime shifts (batch size 1, where the optimum is exactly computable)."""

from __future__ import annotations

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS, profile_table
from adaptive_spec.sim.recording import RecordingPolicy
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.synthetic import (
    CHAT,
    CODE,
    CREATIVE,
    RETRIEVAL,
    Regime,
    RegimeOptimum,
    RequestSpec,
    make_requests,
    shift_across_requests,
    shift_within_request,
    stationary,
)

from adaptive_spec.core.controller import AdaptiveController

PROF = PRESETS["cpu-smollm2"]
TABLE = profile_table(PROF, max_batch=4, max_k=8)  # what calibration would measure
K = 8
PROPS = ["ngram", "jacobi"]


def _run(specs: list[RequestSpec], seed: int) -> tuple[list[Regime], np.ndarray, list[bool]]:
    """Replay the default controller; per decode step: the regime, the pseudo-regret in tokens
    against the regime's optimum, and whether the chosen proposer is the optimum's."""
    reqs = make_requests(specs, K, seed=seed)
    pol = RecordingPolicy(AdaptiveController(PROPS, K, seed=seed, cost_table=TABLE))
    replay(reqs, pol, PROF, max_batch=1)
    spec_of = {r.req_id: s for r, s in zip(reqs, specs, strict=True)}
    optima: dict[str, RegimeOptimum] = {}
    regs, regimes, right = [], [], []
    for rec in pol.log:
        reg = spec_of[rec.req_id].regime_at(rec.position)
        opt = optima.get(reg.name)
        if opt is None:
            opt = optima[reg.name] = RegimeOptimum(reg, PROF, K, PROPS)
        regs.append(opt.regret(rec.offered, rec.arm, rec.remaining))
        regimes.append(reg)
        right.append(rec.arm.proposer == opt.best_arm(rec.offered, rec.remaining).proposer)
    return regimes, np.asarray(regs), right


@pytest.mark.parametrize("regime", [CODE, CHAT], ids=lambda r: r.name)
def test_regret_is_sublinear(regime: Regime) -> None:
    first, last, total = [], [], []
    for seed in range(2):
        _, regs, _ = _run(stationary(regime, 30 if regime is CODE else 40, 100), seed)
        q = len(regs) // 4
        first.append(regs[:q].mean())
        last.append(regs[-q:].mean())
        total.append(regs.sum() / len(regs))
    # Per-step regret falls: the last quarter loses at most half of what the first quarter lost.
    assert np.mean(last) < 0.5 * np.mean(first), (first, last)
    # And the average loss is small against the tokens a step emits (>= 1).
    assert np.mean(total) < 0.03, total


def _latencies(
    regimes: list[Regime], right: list[bool], window: int = 20, need: float = 0.8
) -> list[int]:
    """Decode steps after each regime change until a window of ``window`` steps has at least ``need``
    choices of the optimal proposer."""
    good = np.asarray(right, dtype=float)
    out = []
    for i in range(1, len(regimes)):
        if regimes[i].name == regimes[i - 1].name:
            continue
        seg = good[i : i + 200]
        roll = np.convolve(seg, np.ones(window) / window, mode="valid")
        hit = np.flatnonzero(roll >= need)
        out.append(int(hit[0]) if hit.size else 10**6)
    return out


@pytest.mark.parametrize(
    "specs",
    [
        shift_across_requests([CODE, CHAT], 10, 100),  # code -> chat
        shift_across_requests([CHAT, CODE], 10, 100),  # chat -> code
        shift_within_request(RETRIEVAL, CREATIVE, 64, 8, 160),  # retrieval hit -> creative writing
    ],
    ids=["code-chat", "chat-code", "retrieval-creative"],
)
def test_switches_within_bounded_steps(specs: list[RequestSpec]) -> None:
    for seed in range(2):
        regimes, _, right = _run(specs, seed)
        lat = _latencies(regimes, right)
        assert lat and max(lat) <= 60, lat
        assert np.mean(right) >= 0.85
