"""Replay: reproduction of a recorded run, simulator invariants, the oracle and its bound, the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from adaptive_spec.sim.cost_profiles import PRESETS, LinearCostProfile, fit_linear_profile
from adaptive_spec.sim.oracle import OraclePolicy, PerRequestStaticPolicy, oracle_bound
from adaptive_spec.sim.replay import replay
from adaptive_spec.sim.requests import ReplayRequest
from adaptive_spec.sim.strategies import cost_profiles, workloads
from adaptive_spec.sim.synthetic import (
    CHAT,
    CODE,
    make_requests,
    named_workload,
    record_trace,
    shift_across_requests,
    stationary,
)
from adaptive_spec.sim.trace_io import load_replay_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_spec.commands.cli import main as cli_main
from adaptive_spec.core.arms import Arm, arm_space
from adaptive_spec.core.baselines import StaticPolicy
from adaptive_spec.core.peers import BanditSpecPolicy, SmartSpecPolicy
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.protocol import Decision, SpecPolicy, StepView
from adaptive_spec.core.trace import read_trace

PROPS = ["ngram", "jacobi"]


@pytest.fixture(scope="module")
def static_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """A synthetic trace recorded by static ngram:4 at batch 4, step times from cpu-smollm2 with 3 %
    log-normal noise."""
    reqs = make_requests(shift_across_requests([CODE, CHAT], 6, 80), 8, seed=11)
    pol = StaticPolicy(PROPS, 8, Arm("ngram", 4))
    path = tmp_path_factory.mktemp("static") / "trace.jsonl"
    _, res = record_trace(
        path, reqs, pol, PRESETS["cpu-smollm2"], max_batch=4, step_time_noise=0.03, seed=5
    )
    return path, res.goodput


def test_replaying_the_recording_static_policy_reproduces_goodput(
    static_trace: tuple[Path, float], tmp_path: Path
) -> None:
    path, recorded = static_trace
    wl = load_replay_trace(path)
    assert wl.recorded_goodput == pytest.approx(recorded)
    static = StaticPolicy(PROPS, 8, Arm("ngram", 4))
    # (1) The profile the step times were drawn from (3 % noise around it).
    res = replay(wl.requests, static, PRESETS["cpu-smollm2"], max_batch=wl.max_batch)
    assert abs(res.goodput / wl.recorded_goodput - 1) < 0.05
    # (2) A profile fitted to another policy's trace on the same "hardware" (the adaptive
    # controller on another workload): the cost model transfers across policies.
    other = make_requests(shift_across_requests([CHAT, CODE], 6, 80), 8, seed=12)
    record_trace(
        tmp_path / "adaptive.jsonl",
        other,
        make_policy("adaptive", PROPS, 8, seed=3),
        PRESETS["cpu-smollm2"],
        max_batch=4,
        step_time_noise=0.03,
        seed=6,
    )
    prof = fit_linear_profile(read_trace(tmp_path / "adaptive.jsonl"))
    res = replay(wl.requests, static, prof, max_batch=wl.max_batch)
    assert abs(res.goodput / wl.recorded_goodput - 1) < 0.05
    # (3) A profile fitted to this trace reproduces its total time exactly (least squares with an
    # intercept leaves residuals summing to zero) when the replay makes the same steps.
    res = replay(wl.requests, static, fit_linear_profile(wl.trace), max_batch=wl.max_batch)
    assert res.goodput == pytest.approx(wl.recorded_goodput, rel=1e-6)
    # Step by step, the replay makes the recorded decisions with the recorded outcomes.
    rec_rows = [
        (r["req_id"], r["arm"], r["drafted"], r["accepted"], r["emitted"])
        for s in wl.trace.steps
        for r in s["requests"]
    ]
    assert res.request_steps == len(rec_rows) and res.steps == len(wl.trace.steps)
    assert res.drafted == sum(r[2] for r in rec_rows) and res.accepted == sum(
        r[3] for r in rec_rows
    )
    decode_rows = [r for s in wl.trace.steps for r in s["requests"] if r["num_output_before"] > 0]
    assert res.arm_counts == Counter(r["arm"] for r in decode_rows)


def test_replay_invariants_and_policy_errors() -> None:
    reqs = make_requests(stationary(CODE, 5, 40), 4, seed=2)
    prof = PRESETS["cpu-smollm2"]
    none = replay(reqs, make_policy("none", PROPS, 4), prof, max_batch=2)
    assert none.tokens == sum(len(r) for r in reqs) and none.drafted == 0
    assert none.request_steps == none.tokens and none.mean_accepted_length == 1.0
    assert none.steps == 3 * 40  # 5 requests of 40 tokens, 2 at a time: 2 + 2 + 1
    spec = replay(reqs, make_policy("static:ngram:4", PROPS, 4), prof, max_batch=2)
    assert spec.tokens == none.tokens and spec.mean_accepted_length > 1.0
    assert spec.accepted <= spec.drafted
    assert spec.tokens == int(spec.step_tokens.sum()) and spec.time_s == pytest.approx(
        spec.step_time_s.sum()
    )

    class Wrong(SpecPolicy):
        def decide(self, view: StepView) -> Decision:
            return Decision([], [], [])

    with pytest.raises(ValueError, match="returned 0 arms"):
        replay(reqs, Wrong(PROPS, 4), prof, max_batch=2)

    class Foreign(SpecPolicy):
        def decide(self, view: StepView) -> Decision:
            return Decision(
                [Arm("draft", 2)] * len(view.requests),
                [None] * len(view.requests),
                [[]] * len(view.requests),
            )

    with pytest.raises(ValueError, match="not offered"):
        replay(reqs, Foreign(PROPS, 4), prof, max_batch=2)
    with pytest.raises(ValueError, match="max_batch"):
        replay(reqs, Wrong(PROPS, 4), prof, max_batch=0)
    with pytest.raises(ValueError, match="appears twice"):
        replay([reqs[0], reqs[0]], Wrong(PROPS, 4), prof, max_batch=1)


def test_arrivals_idle_time_not_charged() -> None:
    reqs = make_requests(stationary(CODE, 2, 10), 4, seed=0)
    late = [
        ReplayRequest(
            r.req_id,
            r.prompt_token_ids,
            r.output_token_ids,
            r.max_tokens,
            arrival_s=100.0 * i,
            drafts=r.drafts,
        )
        for i, r in enumerate(reqs)
    ]
    prof = LinearCostProfile(0.01)
    a = replay(late, make_policy("none", PROPS, 4), prof, max_batch=4)
    assert a.time_s == pytest.approx(0.01 * 20)  # served one after the other; idle gap excluded
    assert a.steps == 20


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wl=workloads(), prof=cost_profiles(), max_batch=st.integers(1, 4), data=st.data())
def test_oracle_bound_dominates_every_policy(wl, prof, max_batch: int, data: st.DataObject) -> None:
    reqs, k = wl
    props = sorted({p for r in reqs for p in r.drafts})
    bound = oracle_bound(reqs, prof, max_batch=max_batch, proposers=props, max_k=k)
    arms = arm_space(props, k)
    names = [data.draw(st.sampled_from(arms)) for _ in range(2)]
    policies: list[SpecPolicy] = [StaticPolicy(props, k, a) for a in names]
    policies += [
        OraclePolicy(props, k, requests=reqs, profile=prof, max_batch=max_batch),
        PerRequestStaticPolicy(props, k, requests=reqs, profile=prof, max_batch=max_batch),
        make_policy("adaptive", props, k, seed=data.draw(st.integers(0, 99))),
        SmartSpecPolicy(props, k),
        BanditSpecPolicy(props, k),
    ]
    for pol in policies:
        g = replay(reqs, pol, prof, max_batch=max_batch).goodput
        assert g <= bound.goodput * (1 + 1e-9), pol.name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wl=workloads(), prof=cost_profiles(), data=st.data())
def test_oracle_policy_is_optimal_at_concurrency_one(wl, prof, data: st.DataObject) -> None:
    """At batch size 1 the oracle's shortest path is exact: it attains the bound and beats every
    static arm and the learning policies."""
    reqs, k = wl
    props = sorted({p for r in reqs for p in r.drafts})
    orc = replay(
        reqs, OraclePolicy(props, k, requests=reqs, profile=prof, max_batch=1), prof, max_batch=1
    )
    bound = oracle_bound(reqs, prof, max_batch=1, proposers=props, max_k=k)
    assert orc.goodput == pytest.approx(bound.goodput, rel=1e-9)
    others = [StaticPolicy(props, k, a) for a in arm_space(props, k)]
    others.append(make_policy("adaptive", props, k, seed=data.draw(st.integers(0, 99))))
    for pol in others:
        assert replay(reqs, pol, prof, max_batch=1).goodput <= orc.goodput * (1 + 1e-9), pol.name


def test_oracle_beats_adaptive_and_static_on_named_workloads() -> None:
    prof = PRESETS["cpu-smollm2"]
    for name in ("code-chat", "retrieval-creative", "adversarial", "load-ramp", "load-spike"):
        reqs = make_requests(named_workload(name).specs, 8, seed=0)
        orc = replay(
            reqs,
            OraclePolicy(PROPS, 8, requests=reqs, profile=prof, max_batch=4),
            prof,
            max_batch=4,
        )
        bound = oracle_bound(reqs, prof, max_batch=4, proposers=PROPS, max_k=8)
        for pol in (
            make_policy("adaptive", PROPS, 8),
            StaticPolicy(PROPS, 8, Arm("ngram", 4)),
            StaticPolicy(PROPS, 8, Arm("jacobi", 3)),
        ):
            g = replay(reqs, pol, prof, max_batch=4).goodput
            assert g <= orc.goodput <= bound.goodput * (1 + 1e-9), (name, pol.name)


def test_cli_record_and_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "syn.jsonl"
    assert (
        cli_main(["record", "--synthetic", "code-chat", "--out", str(trace), "--max-k", "4"]) == 0
    )
    assert read_trace(trace).header["policy"] == "static:ngram:4"
    out = tmp_path / "replay"
    rc = cli_main(
        [
            "replay",
            str(trace),
            "--policies",
            "adaptive,static:ngram:4,oracle,banditspec:ngram",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for word in (
        "adaptive",
        "static:ngram:4",
        "oracle",
        "banditspec:ngram",
        "best static",
        "oracle bound",
        "recorded run",
    ):
        assert word in text
    for f in (
        "regret.png",
        "arms_adaptive.png",
        "arms_oracle.png",
        "goodput_by_category.png",
        "summary.json",
    ):
        assert (out / f).stat().st_size > 0
    # A synthetic trace names no engine: the learning policies start from the generic prior.
    assert json.loads((out / "summary.json").read_text())["acceptance_prior"] == "generic"
    assert cli_main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert cli_main(["replay", str(trace), "--policies", "bogus", "--out", str(out)]) == 2
    assert "not known" in capsys.readouterr().out


def test_regret_curves_end_at_the_final_regret() -> None:
    from adaptive_spec.sim.regret import regret, regret_curve

    reqs = make_requests(named_workload("code-chat").specs, 4, seed=0)
    prof = PRESETS["cpu-smollm2"]
    orc = replay(
        reqs, OraclePolicy(PROPS, 4, requests=reqs, profile=prof, max_batch=2), prof, max_batch=2
    )
    pol = replay(reqs, StaticPolicy(PROPS, 4, Arm("ngram", 4)), prof, max_batch=2)
    final = regret(pol, "oracle", orc.goodput)
    assert final.tokens > 0 and 0 < final.gap < 1
    for curve in (regret_curve(pol, orc), regret_curve(pol, orc.goodput)):
        assert curve.shape == (pol.steps,) and curve[-1] == pytest.approx(final.tokens)
    np.testing.assert_allclose(regret_curve(orc, orc), 0.0, atol=1e-9)
    with pytest.raises(ValueError, match="comparator_goodput"):
        regret(pol, "x", 0.0)


EMBEDDED_KEY = {"model": "SmolLM2-135M-Instruct-bfloat16", "dtype": "bfloat16"}


def test_replayed_controller_starts_from_the_shipped_prior_like_the_engine(tmp_path: Path) -> None:
    """Given the recorded engine's key, replay's adaptive controller loads that model's shipped
    acceptance prior (what AdaptiveSpec does when no saved state is loaded); --no-prior or a trace
    without a key leaves the generic prior; a non-learning policy is unaffected."""
    from adaptive_spec.sim.policies import build_policy

    from adaptive_spec.commands.replay import trace_prior_key

    reqs = make_requests(stationary(CODE, 2, 10), 4, seed=2)
    kw = dict(requests=reqs, profile=PRESETS["cpu-smollm2"], max_batch=1)
    shipped = build_policy("adaptive", ["ngram", "jacobi"], 8, prior_key=EMBEDDED_KEY, **kw)
    generic = build_policy("adaptive", ["ngram", "jacobi"], 8, **kw)
    assert shipped.acceptance.loaded == {"ngram", "jacobi"}
    assert generic.acceptance.loaded == frozenset()
    assert not np.allclose(shipped.acceptance.table(), generic.acceptance.table())
    assert build_policy("static:ngram:2", ["ngram"], 8, prior_key=EMBEDDED_KEY, **kw).name
    # Through the CLI: the key comes from the trace header's engine metadata.
    trace = tmp_path / "syn.jsonl"
    assert cli_main(["record", "--synthetic", "code-chat", "--out", str(trace)]) == 0
    lines = trace.read_text().splitlines()
    head = json.loads(lines[0])
    head.setdefault("meta", {})["engine_key"] = {**EMBEDDED_KEY, "threads": 2}
    keyed = tmp_path / "keyed.jsonl"
    keyed.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    assert trace_prior_key(read_trace(keyed)) == {**EMBEDDED_KEY, "threads": 2}
    assert trace_prior_key(read_trace(trace)) is None
    for extra, expected in (([], "shipped"), (["--no-prior"], "generic")):
        out = tmp_path / f"replay-{expected}"
        argv = ["replay", str(keyed), "--policies", "adaptive", "--out", str(out), *extra]
        assert cli_main(argv) == 0
        assert json.loads((out / "summary.json").read_text())["acceptance_prior"] == expected


def test_hindsight_controller_starts_with_the_whole_workloads_acceptance_counts() -> None:
    """``adaptive-hindsight`` is the adaptive controller whose acceptance counts are those a first
    pass over the same requests learned without forgetting: same cells, same counts, the same
    posterior table at its first step; ``build_policy`` (what the replay CLI calls) builds it by
    name, and it is bounded by the oracle like any other policy."""
    from adaptive_spec.sim.cost_profiles import profile_table
    from adaptive_spec.sim.policies import build_policy, hindsight_controller

    from adaptive_spec.core.controller import AdaptiveController

    prof = PRESETS["cpu-smollm2"]
    reqs = make_requests(named_workload("code-chat").specs, 8, seed=0)
    table = profile_table(prof, max_batch=4, max_k=8)
    learner = AdaptiveController(PROPS, 8, cost_table=table, discount=1.0)
    replay(reqs, learner, prof, max_batch=4, proposers=PROPS)
    hs = hindsight_controller(PROPS, 8, requests=reqs, profile=prof, max_batch=4)
    cold = make_policy("adaptive", PROPS, 8)
    judged = learner.acceptance.tri.sum()
    assert judged > 100
    np.testing.assert_allclose(hs.acceptance.tri, learner.acceptance.tri, atol=1e-3)
    np.testing.assert_allclose(hs.acceptance.acc, learner.acceptance.acc, atol=1e-3)
    assert hs.acceptance.tri.sum() > 0 == cold.acceptance.tri.sum()
    assert not np.allclose(hs.acceptance.table(), cold.acceptance.table())
    built = build_policy("adaptive-hindsight", PROPS, 8, requests=reqs, profile=prof, max_batch=4)
    np.testing.assert_allclose(built.acceptance.tri, hs.acceptance.tri)
    orc = OraclePolicy(PROPS, 8, requests=reqs, profile=prof, max_batch=4)
    assert replay(reqs, hs, prof, max_batch=4).goodput <= replay(
        reqs, orc, prof, max_batch=4
    ).goodput * (1 + 1e-9)


def test_replay_charges_the_prefill_the_engine_computed(
    static_trace: tuple[Path, float], tmp_path: Path
) -> None:
    """With a warm prefix cache the engine prefills only part of each prompt and its steps log that
    count; replay charges each request the tokens its engine computed, so a profile fitted to the
    trace still reproduces the trace's total time exactly, and a trace without the counts charges
    whole prompts."""
    path, _ = static_trace
    cached, bare = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "step":
            assert isinstance(rec.get("num_prefill_tokens"), int)
            bare.append(json.dumps({k: v for k, v in rec.items() if k != "num_prefill_tokens"}))
            rec["num_prefill_tokens"] //= 4  # the cache held about three quarters of each prompt
            cached.append(json.dumps(rec))
        else:
            cached.append(line)
            bare.append(line)
    (tmp_path / "cached.jsonl").write_text("\n".join(cached) + "\n")
    (tmp_path / "bare.jsonl").write_text("\n".join(bare) + "\n")
    wl = load_replay_trace(tmp_path / "cached.jsonl")
    logged = sum(s["num_prefill_tokens"] for s in wl.trace.steps)
    prompts = sum(int(r.prompt_token_ids.shape[0]) for r in wl.requests)
    assert 0 < logged < prompts / 2
    assert sum(r.prefill_len for r in wl.requests) == logged
    assert all(0 <= r.prefill_len <= r.prompt_token_ids.shape[0] for r in wl.requests)
    static = StaticPolicy(PROPS, 8, Arm("ngram", 4))
    prof = fit_linear_profile(wl.trace)
    assert prof.c_prefill_token > 0
    res = replay(wl.requests, static, prof, max_batch=wl.max_batch)
    assert res.goodput == pytest.approx(wl.recorded_goodput, rel=1e-6)
    full = load_replay_trace(tmp_path / "bare.jsonl")
    assert all(r.prefill_tokens is None for r in full.requests)
    assert [r.prefill_len for r in full.requests] == [
        int(r.prompt_token_ids.shape[0]) for r in full.requests
    ]


def test_computed_prefill_shares_chunks_and_caps_at_the_prompt() -> None:
    """A step's prefill count, with those of earlier chunk-only steps, goes to the requests whose
    first token it emits, in proportion to their prompts, at most a prompt each; a bad count is
    refused with the parameter named."""
    from adaptive_spec.sim.requests import computed_prefill

    from adaptive_spec.core.trace import Trace

    def step(n: int, *new: str) -> dict:
        reqs = [{"req_id": r, "num_output_before": 0} for r in new]
        return {"num_prefill_tokens": n, "requests": reqs}

    prompts = {"a": 10, "b": 30, "c": 8}
    requests = {r: {"prompt_token_ids": list(range(n))} for r, n in prompts.items()}
    trace = Trace(header={}, requests=requests, steps=[step(8, "a", "b"), step(5), step(3, "c")])
    assert computed_prefill(trace) == {"a": 2, "b": 6, "c": 8}
    trace.steps.append(step(0))
    trace.steps[0] = step(100, "a", "b")
    assert computed_prefill(trace) == {"a": 10, "b": 30, "c": 8}
    del trace.steps[1]["num_prefill_tokens"]
    assert computed_prefill(trace) == {}
    with pytest.raises(ValueError, match="prefill_tokens=11 is invalid"):
        ReplayRequest("a", np.arange(10), np.arange(3), 3, prefill_tokens=11)
