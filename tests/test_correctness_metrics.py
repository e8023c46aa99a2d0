"""Family 7: metrics accounting. Accepted counts, acceptance rates and tokens per step come from
committed tokens; the bonus token is never an accepted draft; zero-draft steps never divide by zero; the
controller's rewards are computed from the same committed counts as the metrics and the trace.

The engine run mixes full acceptance, rejections at every position, k = 0 steps, arms changing every
step and a stop token inside an accepted chunk; every figure of ``AdaptiveSpec.stats()`` is recomputed
from the trace and from the policy's view of the outcomes.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from adaptive_spec.core.controller import AdaptiveController
from adaptive_spec.core.metrics import ArmStats, SpecMetrics
from adaptive_spec.core.policies import make_policy
from adaptive_spec.core.trace import read_trace
from tests.scripted import (
    MAX_K,
    OracleProposer,
    RecordingPolicy,
    ScriptedPolicy,
    core_prompts,
    cycling_correct,
    every_step,
    greedy,
    install_proposer,
    reference,
    references_for,
    stream,
)

PROMPTS = core_prompts()


def _recompute(trace) -> dict[str, dict[str, dict[str, int]]]:
    by: dict[str, dict[str, dict[str, int]]] = {
        "by_arm": defaultdict(lambda: defaultdict(int)),
        "by_proposer": defaultdict(lambda: defaultdict(int)),
        "by_category": defaultdict(lambda: defaultdict(int)),
    }
    for s in trace.steps:
        for r in s["requests"]:
            arm = r["arm"]
            keys = {
                "by_arm": arm,
                "by_proposer": arm.rpartition(":")[0] if arm != "none" else "none",
                "by_category": "all",
            }
            for group, key in keys.items():
                d = by[group][key]
                d["request_steps"] += 1
                d["drafted"] += r["drafted"]
                d["accepted"] += r["accepted"]
                d["emitted"] += r["emitted"]
    return by


def _check_stats_against_trace(stats: dict, trace) -> None:
    for group, table in _recompute(trace).items():
        assert set(stats[group]) == set(table), group
        for key, d in table.items():
            got = stats[group][key]
            for f in ("request_steps", "drafted", "accepted", "emitted"):
                assert got[f] == d[f], f"{group}[{key}].{f}: {got[f]} != {d[f]} (trace)"
            rate = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
            assert got["acceptance_rate"] == round(rate, 4)
            assert got["mean_accepted_length"] == round(d["emitted"] / d["request_steps"], 4)
            assert math.isfinite(got["goodput_tok_s"]) and got["goodput_tok_s"] >= 0


@pytest.mark.vllm
def test_metrics_from_committed_tokens(tiny_llm, tmp_path):
    from adaptive_spec.vllm import AdaptiveSpec

    outs = reference(tiny_llm, PROMPTS, greedy())
    ref = references_for(PROMPTS, outs)
    stop = ref[tuple(PROMPTS[1])][7]  # inside an accepted chunk for the second request
    params = [greedy(), greedy(stop_token_ids=[stop]), greedy(), greedy(), greedy()]
    inner = ScriptedPolicy(
        ["ngram", "jacobi"], MAX_K, every_step(["ngram", "jacobi"], (MAX_K, 2, 0, MAX_K, 1))
    )
    policy = RecordingPolicy(inner)
    path = tmp_path / "trace.jsonl"
    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy=policy, trace=path) as spec:
        inner.bind(spec)
        install_proposer(
            spec, "ngram", OracleProposer(ref, cycling_correct((9, 0, 2, 9, 1, 3)), max_k=MAX_K)
        )
        res = stream(tiny_llm, PROMPTS, params)
    trace = read_trace(path)
    stats = spec.stats()
    total = sum(len(r.token_ids) for r in res)
    assert res[1].finish_reason == "stop" and len(res[1].token_ids) < len(ref[tuple(PROMPTS[1])])
    _check_stats_against_trace(stats, trace)
    assert stats["by_category"]["all"]["emitted"] == total
    rows = [r for s in trace.steps for r in s["requests"]]
    # The bonus token is not an accepted draft: every request-step emits at most accepted + 1, exactly
    # accepted + 1 unless it finished, and accepted never counts tokens that were not committed.
    for r in rows:
        assert r["accepted"] <= min(r["drafted"], r["emitted"])
        assert r["emitted"] == r["accepted"] + 1 or r["finished"]
    full = [
        r for r in rows if r["drafted"] > 0 and r["accepted"] == r["drafted"] and not r["finished"]
    ]
    assert full, "no fully accepted step: the bonus-token check tested nothing"
    assert stats["by_category"]["all"]["accepted"] == sum(r["accepted"] for r in rows)
    assert stats["by_category"]["all"]["emitted"] - stats["by_category"]["all"]["accepted"] == sum(
        1 for r in rows if r["emitted"] > r["accepted"]
    )
    # The arm "none" never carries draft tokens, and zero-draft request-steps emit exactly one token.
    assert stats["by_arm"]["none"]["drafted"] == 0
    assert all(r["emitted"] == 1 for r in rows if r["drafted"] == 0)
    # Steps: one per engine step, step time finite and positive.
    assert stats["steps"] == len(trace.steps) and stats["ignored_step_times"] == 0
    assert math.isfinite(stats["step_time_s"]) and stats["step_time_s"] > 0
    # The controller's rewards use the same committed counts as the trace, request-step by request-step.
    fed: dict[str, list[tuple[int, int, list[int]]]] = defaultdict(list)
    for out in policy.log.outcomes:
        for o in out.requests:
            fed[o.req_id].append((o.drafted, o.accepted, list(o.emitted_token_ids)))
    traced: dict[str, list[tuple[int, int, list[int]]]] = defaultdict(list)
    for s in trace.steps:
        for r in s["requests"]:
            if r["features"] is not None or r["drafted"] > 0:
                traced[r["req_id"]].append((r["drafted"], r["accepted"], r["emitted_token_ids"]))
    assert fed == traced
    # Step outcomes carry the same verified-token count as the trace (what the cost model learns from).
    assert len(policy.log.outcomes) == len(trace.steps)
    for out, st in zip(policy.log.outcomes, trace.steps, strict=True):
        assert out.num_verified_tokens == st["num_verified_tokens"]
        assert out.num_verified_tokens == sum(o.drafted for o in out.requests)
    # The controller's own time inside each step reaches the policy, with its parts (the adaptive
    # controller charges the baseline's counterfactual a static arm's instead).
    assert all(0 < o.controller_time_s < math.inf for o in policy.log.outcomes)
    assert any(set(o.proposer_time_s) == {"ngram", "jacobi"} for o in policy.log.outcomes)
    assert any(o.policy_time_s > 0 for o in policy.log.outcomes)


@pytest.mark.vllm
def test_zero_draft_run_metrics(tiny_llm, tmp_path):
    """Every step without drafts (the controller finds nothing to verify): rates are 0, no division by
    zero anywhere, mean accepted length exactly 1."""
    from adaptive_spec.vllm import AdaptiveSpec
    from tests.scripted import EmptyProposer

    with AdaptiveSpec(tiny_llm, ["none", "ngram", "jacobi"], policy="adaptive") as spec:
        install_proposer(spec, "ngram", EmptyProposer())
        install_proposer(spec, "jacobi", EmptyProposer())
        res = stream(tiny_llm, PROMPTS[:2], greedy(6))
    stats = spec.stats()
    assert set(stats["by_arm"]) == {"none"}
    d = stats["by_arm"]["none"]
    assert d["drafted"] == d["accepted"] == 0 and d["acceptance_rate"] == 0.0
    assert d["mean_accepted_length"] == 1.0 and d["emitted"] == sum(len(r.token_ids) for r in res)


@pytest.mark.vllm
def test_placeholder_drafts_of_a_cached_prompt_are_verified_rows_not_draft_tokens(
    tiny_llm, tmp_path
):
    """vLLM pads a newly admitted request whose prompt is in the prefix cache but for one token with
    ``num_speculative_tokens`` placeholder drafts (-1). No proposer made them: they count as rows the
    step verifies (the cost model's input, in the trace's ``num_verified_tokens``), never as drafted
    tokens in the metrics or the controller's outcomes; the output is unchanged."""
    import random

    from adaptive_spec.vllm import AdaptiveSpec

    block = tiny_llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49000) for _ in range(block + 1)]
    with AdaptiveSpec(tiny_llm, ["none"], policy="none", policy_state=None):
        ref = stream(tiny_llm, [prompt], greedy(6))  # caches the prompt's first block
    sched = tiny_llm.llm_engine.engine_core.engine_core.scheduler
    padded: list[dict] = []
    recorder = RecordingPolicy(make_policy("none", ["none"], MAX_K))
    with AdaptiveSpec(
        tiny_llm, ["none"], policy=recorder, trace=tmp_path / "t.jsonl", policy_state=None
    ) as spec:
        inner = sched.schedule

        def schedule(*a, **k):
            so = inner(*a, **k)
            padded.extend(
                {r: list(d)} for r, d in so.scheduled_spec_decode_tokens.items() if -1 in d
            )
            return so

        sched.schedule = schedule
        try:
            res = stream(tiny_llm, [prompt], greedy(6))
        finally:
            sched.schedule = inner
    assert padded, "vLLM did not pad the cached prompt with placeholder drafts (nothing tested)"
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    stats = spec.stats()
    assert stats["by_arm"]["none"]["drafted"] == 0 and set(stats["by_arm"]) == {"none"}
    trace = read_trace(tmp_path / "t.jsonl")
    assert all(r["drafted"] == 0 for s in trace.steps for r in s["requests"])
    assert sum(s["num_verified_tokens"] for s in trace.steps) == MAX_K * len(padded)
    assert all(o.drafted == 0 for step in recorder.log.outcomes for o in step.requests)


def test_metric_definitions_edge_cases():
    """Unit level: empty stats, zero drafts, zero time, and the bonus token in emitted only."""
    empty = ArmStats()
    assert empty.as_dict() == {
        "request_steps": 0,
        "drafted": 0,
        "accepted": 0,
        "emitted": 0,
        "acceptance_rate": 0.0,
        "mean_accepted_length": 0.0,
        "goodput_tok_s": 0.0,
    }
    m = SpecMetrics()
    m.add_request_step("none", "none", None, 0, 0, 1, 0.0)
    m.add_request_step("ngram:4", "ngram", "code", 4, 4, 5, 0.01)  # all accepted + the bonus token
    m.add_request_step(
        "ngram:4", "ngram", "code", 4, 0, 1, 0.01
    )  # first token rejected: correction
    m.add_step(0.0, 0.0)
    d = m.as_dict()
    assert d["by_arm"]["ngram:4"]["accepted"] == 4 and d["by_arm"]["ngram:4"]["emitted"] == 6
    assert d["by_arm"]["ngram:4"]["acceptance_rate"] == 0.5
    assert d["by_arm"]["ngram:4"]["mean_accepted_length"] == 3.0
    assert d["by_arm"]["none"]["goodput_tok_s"] == 0.0  # no time charged: 0, not a division error
    assert d["controller_overhead"] == 0.0
    assert d["by_category"]["all"]["emitted"] == 1 and d["by_category"]["code"]["emitted"] == 6


def test_controller_learns_from_committed_tokens_only():
    """A stop inside an accepted chunk: the controller's acceptance labels for the chosen proposer are
    the committed prefix (positions past the stop are unknown, not accepted, not rejected)."""
    import numpy as np

    from adaptive_spec.core.arms import Arm
    from adaptive_spec.core.protocol import RequestOutcome, RequestView, StepOutcome, StepView

    ctrl = AdaptiveController(["ngram"], MAX_K, exploration="greedy", seed=0, discount=1.0)
    draft = np.array([5, 6, 7, 8], dtype=np.int64)
    model = ctrl.acceptance
    acc0, tri0 = model.acc.copy(), model.tri.copy()
    v = RequestView("a", 3, 100)
    v.drafts["ngram"] = draft
    ctrl.decide(StepView([v], batch_size=1))
    # Target accepted all 4 raw, but the stop token 6 ended the request after 2 committed tokens.
    ctrl.observe(
        StepOutcome([RequestOutcome("a", Arm("ngram", 4), 4, 2, [5, 6], True)], 0.01, 1, 4)
    )
    # Per position, what was learned (summed over the context cells): one trial and one acceptance
    # at positions 1 and 2; nothing at 3 and 4.
    accepted = (model.acc - acc0).reshape(-1, MAX_K).sum(axis=0)
    trials = (model.tri - tri0).reshape(-1, MAX_K).sum(axis=0)
    labels = [(int((accepted > 0).sum()), int((trials - accepted).sum()))]
    assert accepted[:2].tolist() == [1.0, 1.0] and trials[:2].tolist() == [1.0, 1.0]
    assert not accepted[2:].any() and not trials[2:].any()
    assert labels == [(2, 0)]  # two labelled positions, both accepted; the rest unknown
    assert ctrl.num_tracked_requests() == 0
