"""Family 8: bad input and faults.

* Invalid configuration is refused at construction, with a message naming the parameter and the allowed
  values (controller, baselines, policy names, proposers, cost model, arms, engine builder, AdaptiveSpec).
* A NaN, infinite, zero or negative step time is ignored and counted, never learned from (controller
  level and through the engine, where it is injected into AdaptiveSpec's step clock).
* An exception in the policy (decide, observe, release, a malformed decision) or in a proposer falls
  back to the engine's behaviour for that step: same tokens, the fault counted and traced, the step
  still in the metrics and the trace.
* A trace file that cannot be written (no directory, a full disk, an error in the middle of a run)
  stops tracing with a warning, not generation.
* A corrupt or incompatible policy state file is refused on load, and never half-loaded.
"""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import pytest

from adaptive_spec.core.arms import Arm
from adaptive_spec.core.baselines import BatchSizeTablePolicy, StaticPolicy
from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.cost_model import StepCostModel
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.protocol import RequestOutcome, RequestView, StepOutcome, StepView
from adaptive_spec.core.state import load_policy_state, policy_state_json, save_policy_state
from adaptive_spec.core.trace import read_trace
from adaptive_spec.proposers import JacobiProposer, NgramProposer
from tests.scripted import (
    MAX_K,
    FaultyPolicy,
    OracleProposer,
    RaisingProposer,
    RecordingPolicy,
    core_prompts,
    cycling_correct,
    generate,
    greedy,
    install_proposer,
    reference,
    references_for,
)

PROMPTS = core_prompts()

# (constructor, kwargs, parameter name as written in the message, fragment of the allowed range)
P = ["ngram", "jacobi"]
INVALID = [
    (AdaptiveController, {"proposers": P, "max_k": -1}, "max_k=-1", ">= 0"),
    (AdaptiveController, {"proposers": P, "max_k": 2.5}, "max_k=2.5", ">= 0"),
    (AdaptiveController, {"proposers": ["magic"], "max_k": 4}, "proposer='magic'", "allowed"),
    (
        AdaptiveController,
        {"proposers": P, "max_k": 4, "exploration": "boltzmann"},
        "exploration=",
        "thompson",
    ),
    (
        AdaptiveController,
        {"proposers": P, "max_k": 4, "epsilon": -0.1},
        "epsilon=",
        "0 <= epsilon <= 1",
    ),
    (
        AdaptiveController,
        {"proposers": P, "max_k": 4, "epsilon": math.nan},
        "epsilon=",
        "0 <= epsilon <= 1",
    ),
    (AdaptiveController, {"proposers": P, "max_k": 4, "ema": 0.0}, "ema=", "0 < ema <= 1"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "discount": 0.0}, "discount", "<= 1"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "discount": 1.5}, "discount", "<= 1"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "alpha": 1.0}, "alpha=", "0 <= alpha < 1"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "alpha": -0.1}, "alpha=", "0 <= alpha < 1"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "ucb_bonus": -1.0}, "ucb_bonus=", ">= 0"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "ucb_bonus": math.nan}, "ucb_bonus=", ">= 0"),
    (AdaptiveController, {"proposers": P, "max_k": 4, "probe_every": 0}, "probe_every=", ">= 1"),
    (
        AdaptiveController,
        {"proposers": P, "max_k": 4, "baseline": "static:ngram:9"},
        "baseline=",
        "0..4",
    ),
    (AdaptiveController, {"proposers": P, "max_k": 4, "seed": -1}, "seed=", ">= 0"),
    (StaticPolicy, {"proposers": P, "max_k": 4, "arm": Arm("ngram", 5)}, "k=5", "0..4"),
    (
        StaticPolicy,
        {"proposers": ["ngram"], "max_k": 4, "arm": Arm("jacobi", 2)},
        "proposer='jacobi'",
        "enabled",
    ),
    (
        BatchSizeTablePolicy,
        {"proposers": P, "max_k": 4, "proposer": "ngram", "table": [[0, 2, 1]]},
        "table row",
        "1 <= start <= end",
    ),
    (
        BatchSizeTablePolicy,
        {"proposers": P, "max_k": 4, "proposer": "ngram", "table": [[1, 2, 9]]},
        "table row",
        "0 <= k <= 4",
    ),
    (
        make_policy,
        {"name": "table:ngram:1-x=2", "proposers": P, "max_k": 4},
        "policy=",
        "table:ngram:",
    ),
    (make_policy, {"name": "greedy", "proposers": P, "max_k": 4}, "policy='greedy'", "adaptive"),
    (NgramProposer, {"min_n": 0}, "min_n=0", ">= 1"),
    (NgramProposer, {"min_n": 3, "max_n": 2}, "max_n=2", ">= min_n"),
    (NgramProposer, {"window": 1}, "window=1", "[2, "),
    (NgramProposer, {"max_k": 200}, "max_k=200", "[0, 128]"),
    (NgramProposer, {"backend": "cuda"}, "backend=", "numpy"),
    (JacobiProposer, {"pool_size": 0}, "pool_size=0", "[1, 4096]"),
    (JacobiProposer, {"ngram": 1}, "ngram=1", "[2, 16]"),
    (JacobiProposer, {"init": "zeros"}, "init=", "repeat"),
    (JacobiProposer, {"max_states": 0}, "max_states=0", ">= 1"),
    (StepCostModel, {"load_rate": 0.0}, "load_rate=", "0 < load_rate <= 1"),
    (StepCostModel, {"refresh_every": 0}, "refresh_every=", ">= 1"),
    (StepCostModel, {"prior_weight": math.nan}, "prior_weight=", "> 0"),
    (Arm, {"proposer": "ngram", "k": -1}, "k=-1", ">= 0"),
    (Arm, {"proposer": "none", "k": 2}, "k=2", "k = 0"),
    (Arm.parse, {"text": "ngram:x"}, "arm='ngram:x'", "<proposer>:<k>"),
]


def _id(i: int, case) -> str:
    return f"{i}-{getattr(case[0], '__qualname__', case[0])}-{case[2]}"


@pytest.mark.parametrize("case", INVALID, ids=[_id(i, c) for i, c in enumerate(INVALID)])
def test_invalid_configuration_refused(case):
    fn, kw, name, allowed = case
    with pytest.raises(ValueError) as err:
        fn(**kw)
    msg = str(err.value)
    assert name in msg, f"the message does not name the parameter ({name!r}): {msg}"
    assert allowed in msg, f"the message does not state the allowed values ({allowed!r}): {msg}"


@pytest.mark.parametrize(
    ("kw", "name", "allowed"),
    [
        ({"max_k": 0}, "max_k=0", "1..16"),
        ({"concurrency": 0}, "concurrency=0", ">= 1"),
        ({"method": "eagle"}, "method='eagle'", "ngram"),
        ({"dtype": "float16"}, "dtype='float16'", "float32"),
        ({"method": "draft_model"}, "draft_model", "path"),
    ],
)
def test_engine_builder_refuses_before_building(kw, name, allowed):
    from adaptive_spec.vllm.engine import build_llm

    with pytest.raises(ValueError) as err:
        build_llm("/nonexistent", **kw)
    assert name in str(err.value) and allowed in str(err.value)


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"proposers": []}, "proposers=[]"),
        ({"proposers": ["none", "lora:code"]}, "lora:code"),
        ({"proposers": ["none", "ngram"], "ngram_min": 0}, "ngram_min=0"),
        ({"proposers": ["none", "ngram"], "ngram_min": 3, "ngram_max": 2}, "ngram_max=2"),
        ({"proposers": ["none", "ngram"], "policy": "adaptive", "seed": -3}, "seed=-3"),
    ],
)
def test_adaptive_spec_refuses_and_attaches_nothing(tiny_llm, kw, name):
    from adaptive_spec.vllm import AdaptiveSpec

    sched = tiny_llm.llm_engine.engine_core.engine_core.scheduler
    before = set(vars(sched))
    with pytest.raises(ValueError) as err:
        AdaptiveSpec(tiny_llm, **kw)
    assert name in str(err.value), str(err.value)
    assert set(vars(sched)) == before


# -- step times ------------------------------------------------------------------------------------
def test_bad_step_times_ignored_and_counted_by_the_controller():
    ctrl = AdaptiveController(["ngram"], MAX_K, seed=0)
    v = RequestView("a", 1, 100)
    v.drafts["ngram"] = np.array([1, 2, 3, 4], dtype=np.int64)
    ctrl.decide(StepView([v], batch_size=1))
    ctrl.observe(
        StepOutcome([RequestOutcome("a", Arm("ngram", 2), 2, 1, [1, 9], False)], 0.02, 1, 2)
    )
    table = ctrl.cost.table.seconds.copy()
    load = ctrl.cost.log_load
    n = ctrl.cost.n_updates
    for bad in (math.nan, math.inf, -math.inf, -0.01, 0.0):
        ctrl.decide(StepView([v], batch_size=1))
        ctrl.observe(
            StepOutcome([RequestOutcome("a", Arm("ngram", 2), 2, 1, [1, 9], False)], bad, 1, 2)
        )
    assert ctrl.cost.n_ignored == 5 and ctrl.cost.n_updates == n
    assert np.array_equal(ctrl.cost.table.seconds, table) and ctrl.cost.log_load == load
    assert np.isfinite(ctrl.cost.predict(4, 8)).all()


@pytest.mark.vllm
def test_bad_step_times_through_the_engine(tiny_llm, tmp_path):
    """Every other step's clock reads NaN or runs backwards: those steps are counted as ignored, the
    cost model never sees them, the totals stay finite, and the tokens are unchanged."""
    from adaptive_spec.vllm import AdaptiveSpec

    ref = references_for(PROMPTS[:2], reference(tiny_llm, PROMPTS[:2], greedy(8)))
    ctrl = AdaptiveController(["ngram", "jacobi"], MAX_K, seed=0)
    policy = RecordingPolicy(ctrl)
    injected = []
    with AdaptiveSpec(
        tiny_llm, ["none", "ngram", "jacobi"], policy=policy, trace=tmp_path / "t.jsonl"
    ) as spec:
        hooked = spec.scheduler.schedule

        def schedule(*a, **k):
            out = hooked(*a, **k)
            i = len(injected)
            injected.append(i % 3)
            if i % 3 == 1:
                spec.hooks.clock.tau_prev = spec.hooks.clock.t_schedule = math.nan
            elif i % 3 == 2:
                # the clock runs backwards
                spec.hooks.clock.tau_prev = spec.hooks.clock.t_schedule = (
                    time.perf_counter() + 1000.0
                )
            return out

        spec.scheduler.schedule = schedule
        outs = generate(tiny_llm, PROMPTS[:2], greedy(8))
    assert references_for(PROMPTS[:2], outs) == ref
    bad = sum(1 for i in injected if i != 0)
    stats = spec.stats()
    assert bad > 0 and stats["ignored_step_times"] == bad
    good = ctrl.cost.n_updates + ctrl.cost.n_prefill  # decode steps and prefill steps
    assert ctrl.cost.n_ignored == bad and good == len(injected) - bad
    assert math.isfinite(stats["step_time_s"]) and stats["step_time_s"] > 0
    assert math.isfinite(stats["controller_overhead"])
    assert np.isfinite(ctrl.cost.table.seconds).all() and math.isfinite(ctrl.cost.load)


# -- policy and proposer faults --------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("where", ["decide", "observe", "release", "malformed", "proposer"])
def test_policy_and_proposer_faults_fall_back(tiny_llm, tmp_path, where):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts = PROMPTS[:3]
    ref = references_for(prompts, reference(tiny_llm, prompts, greedy(10)))
    arm = Arm("ngram", MAX_K)
    if where == "proposer":
        policy = FaultyPolicy(["ngram", "jacobi"], MAX_K, "observe", arm, every=10**9)
    else:
        policy = FaultyPolicy(["ngram", "jacobi"], MAX_K, where, arm, every=2)
    path = tmp_path / "trace.jsonl"
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy, trace=path) as spec:
        oracle = OracleProposer(ref, cycling_correct((9, 1)), max_k=MAX_K)
        install_proposer(spec, "ngram", RaisingProposer(oracle) if where == "proposer" else oracle)
        outs = generate(tiny_llm, prompts, greedy(10))
    assert references_for(prompts, outs) == ref
    stats = spec.stats()
    assert spec.faults > 0 and stats["faults"] == spec.faults
    trace = read_trace(path)
    assert any(s["fault"] for s in trace.steps), "no traced step names the fault"
    # The faulty steps are still in the metrics and in the trace.
    total = sum(len(o.token_ids) for o in outs)
    assert sum(r["emitted"] for s in trace.steps for r in s["requests"]) == total
    assert stats["by_category"]["all"]["emitted"] == total
    assert stats["steps"] == len(trace.steps)
    assert stats["tracked_requests"] == 0


# -- trace files -----------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["no-directory", "disk-full", "mid-run"])
def test_unwritable_trace_stops_tracing_not_generation(tiny_llm, tmp_path, caplog, kind):
    from adaptive_spec.vllm import AdaptiveSpec

    prompts = PROMPTS[:2]
    ref = references_for(prompts, reference(tiny_llm, prompts, greedy(8)))
    if kind == "no-directory":
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        path = blocker / "trace.jsonl"
    elif kind == "disk-full":
        path = "/dev/full"
    else:
        path = tmp_path / "trace.jsonl"
    caplog.set_level(logging.WARNING, logger="adaptive_spec.core.trace")
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy="adaptive", trace=path) as spec:
        if kind == "mid-run":
            f = spec.tracer._f
            calls = [0]

            class Failing:
                def write(self, s):
                    calls[0] += 1
                    if calls[0] > 3:
                        raise OSError(28, "No space left on device")
                    return f.write(s)

                def flush(self):
                    f.flush()

                def close(self):
                    f.close()

            spec.tracer._f = Failing()
        outs = generate(tiny_llm, prompts, greedy(8))
        if kind == "no-directory":
            assert not spec.tracer.enabled
    assert references_for(prompts, outs) == ref
    assert not spec.tracer.enabled
    assert any("tracing stopped" in r.getMessage() for r in caplog.records), caplog.text
    assert spec.stats()["faults"] == 0


# -- policy state files ----------------------------------------------------------------------------
def _trained_controller() -> AdaptiveController:
    ctrl = AdaptiveController(["ngram", "jacobi"], MAX_K, seed=0)
    rng = np.random.default_rng(0)
    for step in range(30):
        views = []
        for i in range(4):
            v = RequestView(f"r{i}", step, 100)
            v.drafts["ngram"] = rng.integers(0, 9, size=MAX_K).astype(np.int64)
            v.drafts["jacobi"] = rng.integers(0, 9, size=MAX_K).astype(np.int64)
            views.append(v)
        dec = ctrl.decide(StepView(views, batch_size=4))
        outs = [
            RequestOutcome(v.req_id, a, a.k, 0, [int(rng.integers(0, 9))], False)
            for v, a in zip(views, dec.arms, strict=True)
        ]
        ctrl.observe(StepOutcome(outs, 0.01 + 0.001 * step, 4, sum(a.k for a in dec.arms)))
    return ctrl


def _corruptions(good: str) -> dict[str, str]:
    doc = json.loads(good)

    def variant(mutate) -> str:
        d = json.loads(good)
        mutate(d)
        return json.dumps(d)

    def nan_second_model(d):
        d["state"]["acceptance"]["acc"][1][0][0][0][0] = float("nan")

    return {
        "empty": "",
        "not-json": "{ this is not json",
        "truncated": good[: len(good) // 2],
        "a-list": "[1, 2, 3]",
        "other-format": variant(lambda d: d.update(format="something-else")),
        "other-version": variant(lambda d: d.update(version=99)),
        "other-policy": variant(lambda d: d.update(policy="static:ngram:4")),
        "other-cells": variant(lambda d: d["state"]["acceptance"].update(shape=[2, 3, 4, 4, 4])),
        "nan-in-second-model": variant(nan_second_model),
        "bad-cost-shape": variant(lambda d: d["state"]["cost"]["table"].update(seconds=[[1.0]])),
        "negative-cost": variant(
            lambda d: d["state"]["cost"]["table"]["seconds"][0].__setitem__(0, -1.0)
        ),
        "missing-cost": variant(lambda d: d["state"].pop("cost")),
        "bad-n-steps": variant(lambda d: d["state"].update(n_steps="many")),
        "other-max-k": variant(lambda d: d["state"].update(max_k=MAX_K + 1)),
        "state-not-dict": json.dumps({**doc, "state": [1, 2]}),
    }


_GOOD = policy_state_json(_trained_controller())


@pytest.mark.parametrize("kind", sorted(_corruptions(_GOOD)))
def test_corrupt_policy_state_refused_never_half_loaded(tmp_path, caplog, kind):
    path = tmp_path / "state.json"
    path.write_text(_corruptions(_GOOD)[kind], encoding="utf-8")
    fresh = AdaptiveController(["ngram", "jacobi"], MAX_K, seed=7)
    before = json.dumps(fresh.state_dict(), sort_keys=True)
    caplog.set_level(logging.WARNING, logger="adaptive_spec.core.state")
    assert load_policy_state(fresh, path) is False
    assert json.dumps(fresh.state_dict(), sort_keys=True) == before, "the policy was (half-)loaded"
    assert any("refused" in r.getMessage() for r in caplog.records), caplog.text


def test_valid_policy_state_loads(tmp_path):
    """The positive control: the uncorrupted file loads completely."""
    trained = _trained_controller()
    path = tmp_path / "state.json"
    save_policy_state(trained, path)
    fresh = AdaptiveController(["ngram", "jacobi"], MAX_K, seed=7)
    assert load_policy_state(fresh, path) is True
    a, b = fresh.state_dict(), trained.state_dict()
    assert json.dumps(a["acceptance"], sort_keys=True) == json.dumps(
        b["acceptance"], sort_keys=True
    )
    assert a["cost"]["table"] == b["cost"]["table"]


@pytest.mark.vllm
def test_corrupt_policy_state_through_adaptive_spec(tiny_llm, tmp_path, caplog):
    """AdaptiveSpec(policy_state=corrupt file) attaches with a fresh controller and a warning; the
    file is moved aside (``.refused-<time>``), so that detach() writes a new one next to it."""
    from adaptive_spec.vllm import AdaptiveSpec

    path = tmp_path / "state.json"
    path.write_text(_corruptions(_GOOD)["nan-in-second-model"], encoding="utf-8")
    caplog.set_level(logging.WARNING, logger="adaptive_spec.core.state")
    spec = AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy="adaptive", policy_state=path)
    try:
        assert spec.policy.n_steps == 0
        assert spec.policy.acceptance.n_updates == 0
        assert any("refused" in r.getMessage() for r in caplog.records)
    finally:
        spec.detach()
    (aside,) = tmp_path.glob("state.json.refused-*")
    assert aside.read_text(encoding="utf-8") == _corruptions(_GOOD)["nan-in-second-model"]
    assert json.loads(path.read_text(encoding="utf-8"))["format"] == "adaptive-spec-policy-state"
