"""SmartSpec and BanditSpec reimplementations."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS, LinearCostProfile
from adaptive_spec.sim.policies import build_policy
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.synthetic import AcceptanceProcess, Regime, make_requests, stationary

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.baselines import StaticPolicy
from adaptive_spec.core.peers import BanditSpecPolicy, SmartSpecPolicy
from adaptive_spec.core.protocol import (
    RequestOutcome,
    RequestView,
    SpecPolicy,
    StepOutcome,
    StepView,
)


def _view(rids: list[str], k: int = 8) -> StepView:
    return StepView(
        [RequestView(r, 5, 100, drafts={"ngram": np.arange(k, dtype=np.int64)}) for r in rids],
        batch_size=len(rids),
    )


def _teach_cost(pol: SmartSpecPolicy, c0: float, cv: float) -> None:
    for V in range(0, 40):
        pol.cost.update(4, V, c0 + cv * V)


def test_smartspec_k_follows_acceptance_and_cost() -> None:
    pol = SmartSpecPolicy(["ngram"], 8, ema=1.0)
    _teach_cost(pol, 0.03, 0.0005)  # verification cheap
    # Request "hi" accepted everything, "lo" rejected its first draft token.
    pol.decide(_view(["hi", "lo"]))
    pol.observe(
        StepOutcome(
            [
                RequestOutcome("hi", Arm("ngram", 4), 4, 4, [1] * 5),
                RequestOutcome("lo", Arm("ngram", 4), 4, 0, [1]),
            ],
            0.035,
            2,
            8,
        )
    )
    assert pol.acceptance("hi") == pytest.approx(0.99) and pol.acceptance("lo") == pytest.approx(
        0.01
    )
    arms = pol.decide(_view(["hi", "lo"])).arms
    assert arms[0].k == 8 and arms[1].k == 0
    # When verification is expensive relative to a step, k shrinks.
    exp = SmartSpecPolicy(["ngram"], 8, prior_acceptance=0.6)
    _teach_cost(exp, 0.01, 0.01)
    cheap = SmartSpecPolicy(["ngram"], 8, prior_acceptance=0.6)
    _teach_cost(cheap, 0.03, 0.0003)
    k_exp = exp.decide(_view(["a"])).arms[0].k
    k_cheap = cheap.decide(_view(["a"])).arms[0].k
    assert k_exp < k_cheap


def test_smartspec_estimate_converges_to_true_rate() -> None:
    reg = Regime("r", {"ngram": AcceptanceProcess(0.7)})
    reqs = make_requests(stationary(reg, 1, 3000), 8, seed=0)

    class Probe(SmartSpecPolicy):
        seen: ClassVar[list[float]] = []

        def observe(self, outcome: StepOutcome) -> None:
            super().observe(outcome)
            if outcome.requests:
                self.seen.append(self.acceptance(outcome.requests[0].req_id))

    pol = Probe(["ngram"], 8, ema=0.02)
    replay(reqs, pol, PRESETS["cpu-smollm2"], max_batch=1)
    assert np.mean(pol.seen[len(pol.seen) // 2 :]) == pytest.approx(0.7, abs=0.05)


def test_banditspec_finds_the_best_k() -> None:
    """On a stationary workload at batch 1, UCB's most played k (second half) is the best static k."""
    reg = Regime("r", {"ngram": AcceptanceProcess(0.55)})
    prof = LinearCostProfile(0.03, 0.0, 0.004)  # verification costs: a middle k is best
    reqs = make_requests(stationary(reg, 20, 300), 8, seed=1)
    goodput = {
        k: replay(
            reqs,
            StaticPolicy(["ngram"], 8, Arm("ngram", k) if k else Arm("none", 0)),
            prof,
            max_batch=1,
        ).goodput
        for k in range(9)
    }
    best = max(goodput, key=goodput.get)
    assert 0 < best < 8
    pol = BanditSpecPolicy(["ngram"], 8, c=0.5)

    class Count(SpecPolicy):
        def __init__(self, inner: BanditSpecPolicy) -> None:
            super().__init__(inner.proposers, inner.max_k)
            self.inner, self.ks = inner, []

        def decide(self, view: StepView):
            d = self.inner.decide(view)
            if view.requests:
                self.ks.append(int(self.inner.ks[self.inner._pending]))
            return d

        def observe(self, outcome: StepOutcome) -> None:
            self.inner.observe(outcome)

    c = Count(pol)
    res = replay(reqs, c, prof, max_batch=1)
    half = np.asarray(c.ks[len(c.ks) // 2 :])
    top = np.bincount(half, minlength=9)
    assert abs(int(np.argmax(top)) - best) <= 1
    assert res.goodput >= 0.9 * goodput[best]


def test_peer_validation_and_names() -> None:
    with pytest.raises(ValueError, match="not enabled"):
        SmartSpecPolicy(["ngram"], 4, proposer="jacobi")
    with pytest.raises(ValueError, match="ema"):
        SmartSpecPolicy(["ngram"], 4, ema=0.0)
    with pytest.raises(ValueError, match="ks"):
        BanditSpecPolicy(["ngram"], 4, ks=[5])
    with pytest.raises(ValueError, match="c="):
        BanditSpecPolicy(["ngram"], 4, c=0)
    reqs = make_requests(stationary(Regime("r", {"ngram": AcceptanceProcess(0.5)}), 1, 5), 4)
    kw = dict(requests=reqs, profile=PRESETS["cpu-smollm2"], max_batch=1)
    assert build_policy("smartspec:ngram", ["ngram", "jacobi"], 4, **kw).name == "smartspec:ngram"
    assert build_policy("smartspec+", ["jacobi", "ngram"], 4, **kw).score_unverified
    assert (
        build_policy("banditspec:jacobi", ["ngram", "jacobi"], 4, **kw).name == "banditspec:jacobi"
    )
    with pytest.raises(ValueError, match="not known"):
        build_policy("nonsense", ["ngram"], 4, **kw)
