"""Off-policy estimators against known ground truth."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS
from adaptive_spec.sim.ope import (
    ESTIMATORS,
    LoggedBandit,
    doubly_robust,
    evaluate,
    ips,
    logged_bandit_from_trace,
    snips,
    static_target,
    synthetic_logs,
)
from adaptive_spec.sim.synthetic import CODE, make_requests, record_trace, stationary

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.trace import read_trace

SEEDS = range(30)


@pytest.fixture(scope="module")
def runs() -> list[tuple[dict, float]]:
    out = []
    for seed in SEEDS:
        logs, tp, truth = synthetic_logs(1500, seed=seed)
        out.append((evaluate(logs, tp, n_boot=200, seed=seed), truth))
    return out


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_bootstrap_interval_covers_truth(runs, estimator: str) -> None:
    covered = sum(r[estimator].low <= truth <= r[estimator].high for r, truth in runs)
    assert covered >= 0.9 * len(runs), f"{estimator}: {covered}/{len(runs)}"


def test_ips_and_dr_are_unbiased_across_seeds(runs) -> None:
    for e in ("ips", "dr"):
        diffs = np.array([r[e].value - truth for r, truth in runs])
        se = diffs.std(ddof=1) / np.sqrt(len(diffs))
        assert abs(diffs.mean()) < 3 * se + 1e-3, e
    # DR is the tighter estimator here (a good reward model).
    w_ips = np.mean([r["ips"].high - r["ips"].low for r, _ in runs])
    w_dr = np.mean([r["dr"].high - r["dr"].low for r, _ in runs])
    assert w_dr < w_ips


def test_estimator_identities() -> None:
    logs, tp, _ = synthetic_logs(500, seed=3)
    n, A = len(logs), len(logs.action_names)
    assert doubly_robust(logs, tp, q=np.zeros((n, A))) == pytest.approx(ips(logs, tp))
    # Evaluating the logging policy itself: all weights are 1.
    mu = np.zeros((n, A))
    mu[np.arange(n), logs.actions] = 1.0
    flat = LoggedBandit(logs.contexts, logs.actions, logs.rewards, np.ones(n), logs.action_names)
    assert ips(flat, mu) == pytest.approx(logs.rewards.mean())
    assert snips(flat, mu) == pytest.approx(logs.rewards.mean())
    with pytest.raises(ValueError, match="shape"):
        ips(logs, tp[:, :2])
    with pytest.raises(ValueError, match="probability"):
        ips(logs, tp * 2)
    with pytest.raises(ValueError, match="propensities"):
        LoggedBandit(logs.contexts, logs.actions, logs.rewards, np.zeros(n), logs.action_names)
    with pytest.raises(ValueError, match="not known"):
        evaluate(logs, tp, estimators=("magic",))


def test_ope_from_an_eps_greedy_trace(tmp_path: Path) -> None:
    """Logs of the controller in eps-greedy mode (exact propensities) estimate a static arm's tokens
    per request-step, whose true value follows from the synthetic acceptance process."""
    reqs = make_requests(stationary(CODE, 12, 300), 4, seed=7)
    pol = AdaptiveController(["ngram", "jacobi"], 4, exploration="eps-greedy", epsilon=0.5, seed=1)
    path, _ = record_trace(tmp_path / "eps.jsonl", reqs, pol, PRESETS["cpu-smollm2"], max_batch=2)
    logs = logged_bandit_from_trace(read_trace(path), reward="tokens")
    assert len(logs) > 1000 and logs.propensities.min() >= 0.5 / 9 - 1e-9
    for arm in (Arm("ngram", 3), Arm("jacobi", 2)):
        proc = CODE.processes[arm.proposer]
        truth = 1 + proc.offer * proc.expected_accepted(arm.k, 4)
        # Four intervals are checked at once (two arms, two estimators): 99.5 % each keeps the
        # family-wise level at 98 %.
        est = evaluate(logs, static_target(logs, arm), n_boot=300, level=0.995, seed=0)
        for e in ("snips", "dr"):
            slack = (
                0.05  # requests' last tokens are truncated by the budget (a small downward bias)
            )
            assert est[e].low - slack <= truth <= est[e].high + slack, (arm, e, est[e], truth)
