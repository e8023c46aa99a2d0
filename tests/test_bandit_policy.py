"""``bandit:<learner>``: every registered learner plays speculative decoding in replay.

Each replay runs, is deterministic under a seed, only chooses arms of the arm space, and learns
from the rewards the module docstring of :mod:`adaptive_spec.core.bandit_policy` defines.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from adaptive_spec.bandits import POLICIES, available_policies
from adaptive_spec.sim.compare import compare_policies
from adaptive_spec.sim.cost_profiles import PRESETS
from adaptive_spec.sim.policies import build_policy
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.synthetic import CHAT, CODE, make_requests, shift_across_requests

from adaptive_spec.core.arms import arm_space
from adaptive_spec.core.bandit_policy import BanditPolicy, RequestContext, learner_name
from adaptive_spec.core.policies import POLICY_NAMES, check_policy_name, make_policy
from adaptive_spec.core.protocol import (
    Decision,
    RequestOutcome,
    RequestView,
    SpecPolicy,
    StepOutcome,
    StepView,
)

PROPS = ["ngram", "jacobi"]
MAX_K = 4
PROFILE = PRESETS["cpu-smollm2"]


@pytest.fixture(scope="module")
def requests():
    return make_requests(shift_across_requests([CODE, CHAT], 6, 60), 6, seed=3)


class _Recorder(SpecPolicy):
    """Wraps a policy and records every arm it decides."""

    def __init__(self, inner: SpecPolicy) -> None:
        super().__init__(list(inner.proposers), inner.max_k)
        self.inner = inner
        self.name = inner.name
        self.arms: list[str] = []
        self.propensities: list[float | None] = []

    def decide(self, view: StepView) -> Decision:
        d = self.inner.decide(view)
        self.arms += [str(a) for a in d.arms]
        self.propensities += list(d.propensities)
        return d

    def observe(self, outcome: StepOutcome) -> None:
        self.inner.observe(outcome)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)


def _replay(requests, name: str, seed: int):
    pol = build_policy(
        name, PROPS, MAX_K, requests=requests, profile=PROFILE, max_batch=4, seed=seed
    )
    rec = _Recorder(pol)
    res = replay(requests, rec, PROFILE, max_batch=4, proposers=PROPS)
    return res, rec, pol


@pytest.mark.parametrize("learner", available_policies())
def test_every_learner_replays_deterministically_inside_the_arm_space(requests, learner) -> None:
    res, rec, pol = _replay(requests, f"bandit:{learner}", seed=7)
    again, rec2, _ = _replay(requests, f"bandit:{learner}", seed=7)
    space = {str(a) for a in arm_space(PROPS, MAX_K)}
    assert rec.arms and set(rec.arms) <= space
    assert rec.arms == rec2.arms
    assert res.goodput == again.goodput and res.tokens == sum(len(r) for r in requests)
    # The learners learned: every decode request-step with a usable time fed one observation
    # (full information: one per arm).
    n = sum(p.n_updates for p in pol.learners.values())
    per = len(space) if POLICIES[learner].full_information_only else 1
    assert 0 < n <= per * len(rec.arms)
    # Exact propensities where the learner has a closed form, None where it samples.
    if POLICIES[learner].has_probabilities:
        assert all(p is not None and 0 < p <= 1 for p in rec.propensities)
    else:
        assert all(p is None for p in rec.propensities)
    # The state round-trips through JSON.
    clone = build_policy(
        f"bandit:{learner}", PROPS, MAX_K, requests=requests, profile=PROFILE, max_batch=4
    )
    clone.load_state_dict(json.loads(json.dumps(pol.state_dict())))
    assert clone.state_dict() == json.loads(json.dumps(pol.state_dict()))


def test_a_seed_changes_the_randomised_learners_choices(requests) -> None:
    _, a, _ = _replay(requests, "bandit:thompson-beta", seed=1)
    _, b, _ = _replay(requests, "bandit:thompson-beta", seed=2)
    assert a.arms != b.arms


def test_names_and_errors() -> None:
    assert "bandit:<learner>" in POLICY_NAMES
    assert learner_name("thompson_beta") == "thompson-beta"
    pol = make_policy("bandit:thompson_beta", PROPS, MAX_K)
    assert isinstance(pol, BanditPolicy) and pol.name == "bandit:thompson-beta"
    assert check_policy_name("bandit:linucb", ["none", *PROPS]) == "bandit:linucb"
    with pytest.raises(ValueError, match=r"learner='nope' is not known; allowed: .*ucb1"):
        make_policy("bandit:nope", PROPS, MAX_K)
    with pytest.raises(ValueError, match="seed"):
        BanditPolicy(PROPS, MAX_K, learner="ucb1", seed=-1)
    with pytest.raises(TypeError):
        BanditPolicy(PROPS, MAX_K, learner="ucb1", no_such_argument=1)
    with pytest.raises(ValueError, match="state is for"):
        pol.load_state_dict({"name": "bandit:ucb1", "learners": {}})


def test_context_reuses_the_controllers_buckets() -> None:
    pol = BanditPolicy(PROPS, MAX_K, learner="linucb")
    v = RequestView(
        "r",
        1,
        100,
        temperature=0.7,
        drafts={"ngram": np.arange(3), "jacobi": np.arange(2)},
        match_lengths={"ngram": 4, "jacobi": 2},
    )
    ctx = pol.context(v)
    # ngram thresholds (1, 3, 4): feature 4 -> bucket 3; jacobi (1, 3, 5): feature 2 -> bucket 1.
    assert ctx == RequestContext(1, (0, 0), (3, 1))
    x = ctx.vector(4)
    assert x.shape == (pol.dim,) and pol.dim == 3 + 8 * len(PROPS)
    assert x[:3].tolist() == [1.0, 1.0, 0.25]
    assert x.sum() == pytest.approx(2.25 + 2 * len(PROPS))
    # After the ngram draft is accepted in full, the request's ngram history is high.
    d = pol.decide(StepView([v], batch_size=1))
    pol.observe(StepOutcome([RequestOutcome("r", d.arms[0], 0, 0, [0, 1, 2, 9])], 0.02, 1, 0))
    assert pol.context(v).history_buckets == (3, 3)  # both drafts' known positions matched


def test_reward_is_the_requests_share_of_goodput_relative_to_plain_decoding() -> None:
    pol = BanditPolicy(["ngram"], 4, learner="ucb1")
    v = RequestView("r", 1, 100, drafts={"ngram": np.arange(4)}, match_lengths={"ngram": 4})
    pol.decide(StepView([v], batch_size=1))
    out = StepOutcome([], pol.cost.at(1, 0), 1, 0)
    shares = pol._shares(out)
    # A plain step at the predicted time: reward 1 / (max_k + 1) for one committed token.
    assert shares.reward(0, 0, 4) == pytest.approx(1 / 5)
    # A step verifying 4 draft tokens, 3 accepted, at the predicted time of that step.
    out = StepOutcome([], pol.cost.at(1, 4), 1, 4)
    shares = pol._shares(out)
    expected = 4 * pol.cost.at(1, 0) / pol.cost.at(1, 4) / 5
    assert shares.reward(3, 4, 4) == pytest.approx(expected)


def test_bandit_learners_are_compared_with_the_controller_and_the_oracle(requests) -> None:
    cmp = compare_policies(
        requests,
        ["adaptive", "bandit:thompson-beta", "bandit:linucb"],
        PROFILE,
        proposers=PROPS,
        max_k=MAX_K,
        max_batch=4,
    )
    for name in ("bandit:thompson-beta", "bandit:linucb"):
        assert 0 < cmp.results[name].goodput <= cmp.bound.goodput * (1 + 1e-9)
        assert set(cmp.regrets(name)) == {"best-static", "per-request-static", "oracle"}


def test_bench_runs_bandit_configurations_with_the_main_engines_proposers() -> None:
    from adaptive_spec.commands.bench.plan import parse_config
    from adaptive_spec.commands.bench.worker_cell import config_proposers, make_bench_policy

    assert parse_config("bandit:thompson_beta").kind == "peer"
    props = config_proposers("bandit:thompson_beta", "main")
    assert props == ["none", "ngram", "jacobi"]
    pol = make_bench_policy("bandit:thompson_beta", props, 8, seed=3)
    assert isinstance(pol, BanditPolicy) and pol.name == "bandit:thompson-beta"
    assert len(pol.arms) == 1 + 2 * 8
